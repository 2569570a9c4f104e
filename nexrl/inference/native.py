"""The native decode-attention kernel: built on first use with the system C compiler.

At decode time each running row attends over its own cache rows, a batch of tiny
matrix products. Through `torch.bmm` that costs far more than the arithmetic (MKL's
per-matrix overhead), and needs a padded mask. `csrc/decode_attention.c` does the
whole attention in one call, reading each row's keys once and only up to its
position (2.5-3x faster than the bmm path at 64 rows; `benchmarks/bench_generation.py`
measures the engine with it).

The library is compiled once per head size, element type and x86-64 ISA level (`cc -O3
-march=x86-64-v3` or `-v4` where the CPU has those instructions, else the architecture's
baseline; never `-march=native`, so one build runs on every machine of its level, about a
second) into `$NEXRL_HOME/native/` and loaded with `ctypes`,
which releases the GIL during the call. Every freshly loaded library is checked
against the torch reference before use. Without a C compiler, or with
`NEXRL_NATIVE=0`, the engine keeps the torch path: same results, slower.

Two element types: fp32, and bf16 (`-DBF16`: the cache and the tensors handed over are
bf16, the arithmetic fp32). In bf16 the alternative is SDPA's fused CPU kernel, about
2 ms per layer for SmolLM2's decode step at 64 rows on 2 CPU cores, against
0.2 ms here: 60 of the step's 130 ms.

Inside a decode step the cache is cold (the step's weights have streamed through the
caches since the layer's last visit), and the kernel ran at about 40% of its in-cache
speed. Three things recover most of it, each measured on SmolLM2's bf16 decode step at
64 rows (2 CPU cores): the query heads of one kv head are attended together, so
each key and value is read once per kv head (attention 11.7 -> 8.6 ms of the step);
the next block of keys and values is prefetched while one is attended; and where torch
runs on libgomp the library is built with OpenMP and splits its (row, kv head) blocks
over the caller's torch threads, on torch's own runtime and threads (8.6 -> 4.8 ms).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.c"
FLAGS = ("-O3", "-ffast-math", "-fopenmp-simd", "-shared", "-fPIC")

# (q, k_new, v_new, kc, vc, pos, rope=None) -> out (rows, heads, head_dim); appends k_new,
# v_new at pos; with rope=(cos, sin) tables it also rotates q and k_new at pos first
DTYPES = {torch.float32: (), torch.bfloat16: ("-DBF16",)}  # element types and their flags
AttentionFn = Callable[..., torch.Tensor]


def enabled() -> bool:
    return os.environ.get("NEXRL_NATIVE", "1") != "0"


X86_64_V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"}
X86_64_V4 = X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


def isa_flags() -> tuple[str, ...]:
    """`-march=x86-64-v4` / `-v3` where this x86-64 CPU has every instruction of that
    level (the psABI's portable levels), else nothing (the compiler's baseline)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(line.partition(":")[2].split())
    for level, needed in (("x86-64-v4", X86_64_V4), ("x86-64-v3", X86_64_V3)):
        if needed <= have:
            return (f"-march={level}",)
    return ()


def _build(head_dim: int, dtype: torch.dtype = torch.float32) -> Path | None:
    """Compile (or find) the attention library for `head_dim` and `dtype` (a key of
    `DTYPES`); None without a working compiler."""
    return build_library(SOURCE, dtype, (f"-DHEAD_DIM={head_dim}",), f"d{head_dim}")


def build_library(
    source: Path, dtype: torch.dtype, defines: tuple[str, ...] = (), tag: str = ""
) -> Path | None:
    """Compile (or find) the library of `source` (a file of `csrc/`, which may include
    `elem.h`) for elements of `dtype`; None without a working compiler."""
    from nexrl.models.tiny import cache_dir

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler found: %s stays on torch", source.name)
        return None
    flags = (*FLAGS, *isa_flags(), f"-I{source.parent}", *defines, *DTYPES[dtype], *openmp_flags())
    texts = [source.read_text(), (source.parent / "elem.h").read_text()]
    key = hashlib.sha256(
        "\0".join([*texts, compiler, *flags, platform.machine()]).encode()
    ).hexdigest()[:16]
    kind = str(dtype).removeprefix("torch.") + ("_fopenmp" if "-fopenmp" in flags else "")
    name = "_".join(x for x in (source.stem, kind, tag, key) if x)
    target = cache_dir() / "native" / f"{name}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [compiler, *flags, str(source), "-o", str(out), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            logger.warning("building %s failed, using torch:\n%s", source.name, proc.stderr)
            return None
        os.replace(out, target)  # atomic: concurrent builders never see a partial file
    return target


def runs_on_torch_openmp(path: Path, before: set[str]) -> bool:
    """True when the library at `path`, just loaded, was built with OpenMP and mapped no
    OpenMP runtime beside the one of `before` (torch's): its loops may then use threads."""
    return bool(before) and openmp_runtimes() == before and "fopenmp" in path.name


def openmp_runtimes() -> set[str]:
    """Paths of the OpenMP runtimes (libgomp) mapped into this process."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    return {ln.split()[-1] for ln in maps if "libgomp" in ln.rsplit("/", 1)[-1]}


def openmp_flags() -> tuple[str, ...]:
    """`-fopenmp` where torch itself runs on libgomp (Linux wheels): the kernel's parallel
    loop then links the runtime torch has loaded (same soname) and reuses its threads.
    Elsewhere the kernel is built single-threaded: a second OpenMP runtime would hold a
    second team of threads on the same cores."""
    openmp = "OpenMP" in torch.__config__.parallel_info()
    return ("-fopenmp",) if openmp and len(openmp_runtimes()) == 1 else ()


def _bind(path: Path) -> Callable[..., None]:
    fn = ctypes.CDLL(str(path)).decode_attention
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr]
    fn.argtypes += [i64, i64, i64, i64, ctypes.c_float, ptr, i64]
    fn.restype = None
    return fn


def reference_attention(q, k_new, v_new, kc, vc, pos, rope=None) -> torch.Tensor:
    """The same step in torch: (rotate,) append at pos, softmax over each row's pos + 1 keys.
    Computes in fp32 whatever the inputs' dtype; the appended keys and the result are
    rounded once to the cache's dtype, as the kernel does."""
    rows, heads, kv, max_len, d = q.shape[0], q.shape[1], kc.shape[1], kc.shape[2], q.shape[2]
    dtype = kc.dtype
    q, k_new, v_new = (t.float() for t in (q, k_new, v_new))
    if rope is not None:
        cos, sin = rope[0][pos][:, None].float(), rope[1][pos][:, None].float()
        q, k_new = (t * cos + t.roll(d // 2, dims=-1) * sin for t in (q, k_new))
    kc[torch.arange(rows), :, pos] = k_new.to(dtype)
    vc[torch.arange(rows), :, pos] = v_new.to(dtype)
    k = kc[:rows].float().repeat_interleave(heads // kv, dim=1)  # (rows, heads, max_len, d)
    v = vc[:rows].float().repeat_interleave(heads // kv, dim=1)
    scores = torch.einsum("bhd,bhld->bhl", q, k) * d**-0.5
    hidden = torch.arange(max_len)[None] > pos[:, None]  # (rows, max_len)
    probs = torch.softmax(scores.masked_fill(hidden[:, None], float("-inf")), dim=-1)
    return torch.einsum("bhl,bhld->bhd", probs, v).to(dtype)


@functools.cache
def decode_attention(
    head_dim: int, max_len: int, dtype: torch.dtype = torch.float32
) -> AttentionFn | None:
    """The native kernel for CPU caches of `head_dim` in `dtype` (fp32 or bf16), or None
    (use torch)."""
    if not enabled() or dtype not in DTYPES:
        return None
    path = _build(head_dim, dtype)
    if path is None:
        return None
    before = openmp_runtimes()
    fn = _bind(path)
    parallel = runs_on_torch_openmp(path, before)
    scale = head_dim**-0.5

    def attend(q, k_new, v_new, kc, vc, pos, rope=None) -> torch.Tensor:
        if kc.dtype != dtype or q.dtype != dtype:
            raise TypeError(f"the {dtype} kernel got a {kc.dtype} cache and {q.dtype} queries")
        q, k_new, v_new = (_rows_of_heads(t, head_dim) for t in (q, k_new, v_new))
        (rows, heads, _), kv = q.shape, kc.shape[1]
        out = torch.empty(rows, heads, head_dim, dtype=dtype)
        threads = torch.get_num_threads() if parallel else 1
        scratch = torch.empty(threads * heads // kv * kc.shape[2])
        cos, sin = (None, None) if rope is None else (t.data_ptr() for t in rope)
        fn(q.data_ptr(), q.stride(0), k_new.data_ptr(), k_new.stride(0), v_new.data_ptr(),
           v_new.stride(0), kc.data_ptr(), vc.data_ptr(), pos.data_ptr(), cos, sin,
           out.data_ptr(), rows, heads, kv, kc.shape[2], scale, scratch.data_ptr(),
           threads)  # fmt: skip
        return out

    if not _self_check(attend, head_dim, max_len, dtype):
        logger.warning("native decode attention disagrees with torch; using torch.bmm")
        return None
    return attend


def _rows_of_heads(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(rows, heads, head_dim) with heads packed (any row stride), as the kernel reads it."""
    return t if t.stride(2) == 1 and t.stride(1) == head_dim else t.contiguous()


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # atol of a result vs the reference


def _self_check(attend: AttentionFn, head_dim: int, max_len: int, dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    q, k_new, v_new = (randn(3, n, head_dim) for n in (4, 2, 2))
    rope = tuple(randn(max_len, head_dim) for _ in range(2))
    pos = torch.tensor([0, max_len // 2, max_len - 1])
    tol = TOLERANCE[dtype]
    for tables in (None, rope):
        kc, vc = randn(5, 2, max_len, head_dim), randn(5, 2, max_len, head_dim)
        want = reference_attention(q, k_new, v_new, kc.clone(), vc.clone(), pos, tables)
        got = attend(q, k_new, v_new, kc, vc, pos, tables)
        if not torch.allclose(got.float(), want.float(), atol=tol, rtol=10 * tol):
            return False
    return True
