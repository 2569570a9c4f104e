"""Data parallelism for the torch engine: SPMD, one engine per rank.

Every rank builds its own `TorchTrainEngine`; the process group comes from the
standard environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), as
set by `torchrun`, a Ray worker group or `launch_local` below. Each rank calls
`train_batch` with its shard of the global batch (`shard_batch`); the engine
all-reduces the token / sequence counts so every rank normalises by the
*global* count, and scales its loss by the world size to undo the gradient
averaging of DDP / FSDP2. The result equals one process on the whole batch.

Why no driver process that spawns ranks and forwards calls: a Ray worker
group already is that driver, and `torchrun` is the other common launcher;
both only need the engine to be SPMD.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist

from nexrl.types import Batch


def world() -> tuple[int, int]:
    """(rank, world_size) of this process; (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init_from_env(device: torch.device) -> tuple[int, int]:
    """Join the process group described by the environment when WORLD_SIZE > 1."""
    rank, size = world()
    if size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, rank=rank, world_size=size)
    return rank, size


def wrap_model(model: torch.nn.Module, strategy: str, device: torch.device) -> torch.nn.Module:
    """DDP or FSDP2 (`fully_shard`) wrapper; the bare model when not distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return model
    if strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in getattr(getattr(model, "model", model), "layers", []):
            fully_shard(layer)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (identity without a process group); returns a new tensor."""
    out = values.detach().clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def shard_batch(batch: Batch, rank: int, world_size: int) -> Batch:
    """Contiguous shard `rank` of `world_size` (sizes differ by at most one row)."""
    n = len(batch)
    start = rank * n // world_size
    stop = (rank + 1) * n // world_size
    return batch.select(list(range(start, stop)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_local(fn: Callable[..., object], world_size: int, *args: object) -> None:
    """Run `fn(rank, world_size, *args)` in `world_size` spawned processes with the env set.

    For tests and single-host CPU runs; `fn` must be importable (a module-level function).
    """
    import torch.multiprocessing as mp

    port = free_port()
    mp.spawn(_entry, args=(fn, world_size, port, args), nprocs=world_size, join=True)


def _entry(
    rank: int, fn: Callable[..., object], world_size: int, port: int, args: tuple[object, ...]
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        fn(rank, world_size, *args)
        if dist.is_initialized():
            # every rank done before any tears down: a gloo group destroyed while a peer
            # still works in it can abort that peer ("terminate called without an active
            # exception", seen once in CI under load)
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
