"""Fused row-wise operations of the decode step, in C (`csrc/fused_ops.c`).

A decode step of a small model at 64 rows is ~120 torch calls of linears and ~300 of
small elementwise work around them: a residual add and an RMSNorm twice per layer (four
ops each in bf16, where the norm is computed in fp32 and rounded back), and
SiLU-times-up. Each is a dispatch and, with two threads, an OpenMP fork and join over
a few thousand elements. `add_rms_norm` folds a residual add into the next RMSNorm and
`silu_mul` the activation into one pass; both round in bf16 where the HF modules do, so
the engine's numbers stay those of the torch path (tested against it).

Built like the attention kernel (`native.py`: per dtype and CPU, OpenMP on torch's own
runtime where torch runs on libgomp), checked against torch before use; None without a
C compiler, with `NEXRL_NATIVE=0`, or for dtypes other than fp32 and bf16.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from nexrl.inference import native

if TYPE_CHECKING:
    from _ctypes import CFuncPtr  # the class of a loaded C function (`ctypes._CFuncPtr`)

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "fused_ops.c"


@dataclass(frozen=True)
class FusedOps:
    """The two operations for tensors of one dtype (rows contiguous, on the CPU)."""

    _add_rms_norm: CFuncPtr
    _silu_mul: CFuncPtr
    parallel: bool

    def _threads(self) -> int:
        return torch.get_num_threads() if self.parallel else 1

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """x += delta in place (delta None: no add); returns w * rmsnorm(x), a new tensor."""
        if not x.is_contiguous():
            raise ValueError("add_rms_norm updates x in place: x must be contiguous")
        delta = None if delta is None else delta.contiguous()
        rows, n = x.shape
        out = torch.empty_like(x)
        ptr = None if delta is None else delta.data_ptr()
        self._add_rms_norm(
            x.data_ptr(), ptr, w.data_ptr(), out.data_ptr(), rows, n, eps, self._threads()
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up (rows, 2n) = [gate | up]: (rows, n)."""
        gate_up = gate_up.contiguous()
        rows, n2 = gate_up.shape
        out = gate_up.new_empty(rows, n2 // 2)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, n2 // 2, self._threads())
        return out


@functools.cache
def fused_ops(dtype: torch.dtype) -> FusedOps | None:
    """The fused operations for `dtype` on a CPU, or None (use torch)."""
    if not native.enabled() or dtype not in native.DTYPES:
        return None
    path = native.build_library(SOURCE, dtype)
    if path is None:
        return None
    before = native.openmp_runtimes()
    lib = ctypes.CDLL(str(path))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, i64]
    lib.silu_mul.argtypes = [ptr, ptr, i64, i64, i64]
    lib.add_rms_norm.restype = lib.silu_mul.restype = None
    ops = FusedOps(lib.add_rms_norm, lib.silu_mul, native.runs_on_torch_openmp(path, before))
    if not _self_check(ops, dtype):
        logger.warning("fused decode ops disagree with torch; using torch")
        return None
    return ops


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, scale in the model dtype (one fused op in fp32)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def torch_add_rms_norm(x, delta, w, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of `add_rms_norm`: (x + delta, RMSNorm of it); x is not modified."""
    if delta is not None:
        x = x + delta
    return x, rms_norm(x, w, eps)


def torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The torch path of `silu_mul`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _self_check(ops: FusedOps, dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    x, delta = (torch.randn(5, 48, generator=gen).to(dtype) for _ in range(2))
    w = torch.rand(48, generator=gen).to(dtype) + 0.5
    want_x, want = torch_add_rms_norm(x, delta, w, 1e-6)
    got_x = x.clone()
    got = ops.add_rms_norm(got_x, delta, w, 1e-6)
    gate_up = torch.randn(5, 96, generator=gen).to(dtype) * 3
    tol = native.TOLERANCE[dtype]
    return all(
        torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)
        for a, b in (
            (got_x, want_x),
            (got, want),
            (ops.silu_mul(gate_up), torch_silu_mul(gate_up)),
        )
    )
