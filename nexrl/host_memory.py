"""Host-memory tuning: the one machine-specific step nexrl keeps in its core.

glibc keeps memory that a train step freed (activations, chunked logits) in its heaps,
one heap per thread that allocated. With a real model on a CPU this grows the process
between steps: the SmolLM2 recipe's trainer, engine and sampling threads gained 2-3 GB
of RSS in three steps. `malloc_trim(0)` hands the free pages back to the OS after each
update; faulting them in again costs a small fraction of such a step.

One switch: `train_worker.engine.release_host_memory` (None = auto: a CPU model of
`AUTO_MIN_PARAMS` or more; never on a GPU, whose tensors are not in glibc's heaps).
"""

from __future__ import annotations

import ctypes
import ctypes.util

AUTO_MIN_PARAMS = 50_000_000
"""Auto switches the release on from this many parameters: a toy model's step takes
milliseconds and would pay the page faults on every step for no memory worth having."""


def release_wanted(setting: bool | None, device_type: str, n_params: int) -> bool:
    """Whether a train engine releases freed host memory after each update."""
    if device_type != "cpu":
        return False
    return setting if setting is not None else n_params >= AUTO_MIN_PARAMS


def release_freed_memory() -> bool:
    """Hand the memory glibc keeps after it was freed back to the OS; False where the
    C library is not glibc (nothing to do there)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False
