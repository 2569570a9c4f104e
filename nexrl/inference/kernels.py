"""The matmul behind the lean forward's linear layers.

On a CPU, `F.linear` runs MKL's sgemm. MKL picks its kernels by CPU vendor: on the AMD
EPYC machines we measure on it stays near 100 GFLOP/s per core, while oneDNN, which
dispatches on the instruction set (AVX-512 here), runs the same fp32 products 1.4-2.4x
faster once they are large enough (`python -m nexrl.inference.kernels` prints the ratio
per shape). oneDNN's linear is reached through `torch.ops.mkldnn._linear_pointwise`, the
op torch's own compiler emits for CPU linears. It costs about 10 µs more per call, so
products below `ONEDNN_MIN_MACS` stay on `F.linear`.

Weights of `PACK_MIN_WEIGHT` elements or more are also handed to oneDNN pre-packed
(`weight_packer`): reordered once into its blocked layout when the runner builds its
weights, instead of at every call. On SmolLM2-135M's decode shapes (2 AMD EPYC cores)
that makes the linears of one step 1.16x faster at 64 rows and 1.4x at 16. Smaller
weights (the tiny default model's) stay as they are: their calls are too short to gain.

Both compute in full fp32 (no TF32/bf16 down-conversion): the logprob parity with the
trainer holds either way (tested). An engine built with `dtype: bfloat16` packs its large
weights too where the CPU multiplies bf16 natively (avx512_bf16 / AMX): on a Xeon with
AMX a bf16 decode linear of SmolLM2 at 64 rows is ~2x faster packed than unpacked, and
~6x faster than fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

ONEDNN_MIN_MACS = 1 << 20  # rows x in x out below which MKL's lower call cost wins
PACK_MIN_WEIGHT = 1 << 18  # in x out from which a weight is packed for oneDNN once
MATMUL_BACKENDS = ("auto", "torch", "onednn")


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """True when oneDNN's linear runs here and agrees with `F.linear`."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    x, w = torch.randn(8, 32, dtype=dtype), torch.randn(16, 32, dtype=dtype)
    try:
        out = _onednn(x, w, None)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    return torch.allclose(out.float(), F.linear(x, w).float(), atol=tol, rtol=tol)


def linear_for(device: torch.device, dtype: torch.dtype, backend: str = "auto") -> LinearFn:
    """The linear to use for weights of `dtype` on `device`.

    `auto`: oneDNN for large products on a CPU where it works, else `F.linear`;
    `torch`: always `F.linear`; `onednn`: oneDNN for every product (errors if missing).
    """
    if backend not in MATMUL_BACKENDS:
        raise ValueError(f"matmul must be one of {MATMUL_BACKENDS}, got {backend!r}")
    on_cpu = torch.device(device).type == "cpu"
    if backend == "onednn":
        if not (on_cpu and onednn_available(dtype)):
            raise ValueError(f"matmul='onednn' is not available for {dtype} on {device}")
        return _onednn
    if backend == "torch" or not on_cpu or not onednn_available(dtype):
        return F.linear

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if w.is_mkldnn or x.numel() // x.shape[-1] * w.numel() >= ONEDNN_MIN_MACS:
            return _onednn(x, w, b)
        return F.linear(x, w, b)

    return linear


def bf16_native() -> bool:
    """True when oneDNN multiplies bf16 natively on this CPU (avx512_bf16 / AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (RuntimeError, AttributeError):
        return False


def weight_packer(
    device: torch.device, dtype: torch.dtype, backend: str = "auto"
) -> Callable[[torch.Tensor], torch.Tensor]:
    """What to apply to each weight for `linear_for(device, dtype, backend)`: large fp32
    CPU weights, and large bf16 ones where the CPU multiplies bf16 natively, become
    oneDNN-packed copies (only that linear can multiply them; the model's own parameters
    are untouched), everything else is returned as is."""
    on_cpu = torch.device(device).type == "cpu"
    packable = dtype == torch.float32 or (dtype == torch.bfloat16 and bf16_native())
    if backend == "torch" or not on_cpu or not packable or not onednn_available(dtype):
        return lambda w: w

    def pack(w: torch.Tensor) -> torch.Tensor:
        if w.numel() < PACK_MIN_WEIGHT:
            return w
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 64)

    return pack


def _compare(repeats: int = 500) -> None:
    """Print F.linear time / oneDNN time for the shapes of small decoder layers."""
    import time

    def clock(fn: LinearFn, x: torch.Tensor, w: torch.Tensor) -> float:
        for _ in range(20):
            fn(x, w, None)
        start = time.perf_counter()
        for _ in range(repeats):
            fn(x, w, None)
        return time.perf_counter() - start

    print("in x out: ratio F.linear / oneDNN at rows 1 .. 256 (>1: oneDNN faster)")
    for k, n in [(128, 256), (128, 512), (512, 1024), (512, 4096), (2048, 512)]:
        cells = []
        for m in (1, 4, 16, 64, 256):
            x, w = torch.randn(m, k), torch.randn(n, k)
            ratio = clock(F.linear, x, w) / clock(_onednn, x, w)
            cells.append(f"{m}:{ratio:.2f}")
        print(f"{k:>5} x {n:<5} " + " ".join(cells))


if __name__ == "__main__":
    torch.set_num_threads(1)
    _compare()
