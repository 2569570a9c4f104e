"""Torch threads for the thread that runs a model: one for a small model on a CPU, and
one for a model on an accelerator.

A local run computes on two threads of one process, the engine's and the trainer's,
each with its own torch thread pool, beside the pipeline's other threads (rollout
workers, the processor). Where the engine and the trainer compute at the same time, a
model under 1M parameters runs on one thread (`threads_for`): its operations are too
small to gain from a pool, and two pools on the same cores wait on each other. A set
`threads` option always wins.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

SMALL_MODEL_PARAMS = 1_000_000
"""Below this many parameters a CPU model runs on one torch thread (unless set)."""


def threads_for(model: torch.nn.Module, threads: int | None, key: str = "threads") -> int | None:
    """The thread count for the thread that runs `model`: `threads` when set (>= 1; `key`
    names the option in the error); else 1 for a model on an accelerator, or a CPU model
    under `SMALL_MODEL_PARAMS` parameters; else None (torch's count, left as it is).

    On an accelerator the thread's own torch work is bookkeeping between kernel launches:
    a team of torch's count (every core of the host) only spins after each parallel
    region, on cores that the interpreter's threads need (vLLM's GPU workers serve on one
    thread for the same reason)."""
    if threads is not None:
        if int(threads) < 1:
            raise ValueError(f"{key} must be >= 1, got {threads}")
        return int(threads)
    params = list(model.parameters())
    if not params:
        return None
    if params[0].device.type != "cpu":
        return 1
    return 1 if sum(p.numel() for p in params) < SMALL_MODEL_PARAMS else None


def use_threads(threads: int | None) -> None:
    """Set the calling thread's torch thread count to `threads` (None: leave it), and
    only that thread's. `torch.set_num_threads` also sets the count that a thread takes
    when it first asks for one (its first parallel op or `get_num_threads`); this thread
    has asked (the check below), so the process's count can be set back, from a short
    thread of its own. A thread that starts its first op in between takes `threads`."""
    if threads is None or torch.get_num_threads() == threads:
        return
    default = _in_fresh_thread(torch.get_num_threads)
    torch.set_num_threads(threads)
    _in_fresh_thread(lambda: torch.set_num_threads(default))


def _in_fresh_thread(fn: Callable[[], T]) -> T:
    out: list[T] = []
    thread = threading.Thread(target=lambda: out.append(fn()), name="nexrl-torch-threads")
    thread.start()
    thread.join()
    return out[0]
