"""AReaL-lite's workflow side (seed 004): episodes that return tensor dicts, and batches.

A seed workflow's `arun_episode(engine, data)` returns a dict of tensors (AReaL's
TensorDict: `input_ids`, `loss_mask`, `logprobs`, `versions`, `attention_mask`
as (1, L) or (L,), `rewards` as (1,) or a scalar). nexrl's `WorkflowExecutor`
trains on trajectory dicts, so `as_nexrl_workflow` converts each episode's
tensors into trajectories (the prompt is everything before the first
`loss_mask` 1), and `DistributedBatch` turns a list of trajectories back into
the seed's padded tensors (`collate`, the processor's own padding) for
`rollout_batch(...)['input_ids']` and `should_accept(x)`.

Simplification: one process holds the batch, so `DistributedBatch.load_data()`
returns the batch itself (the seed's single-controller mode and SPMD mode read
the same).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from nexrl.algorithms.processor import collate
from nexrl.rollout.workflow import EpisodeResult, RolloutWorkflow, Row, as_trajectories
from nexrl.types import Trajectory

__all__ = ["DistributedBatch", "RolloutWorkflow", "as_nexrl_workflow", "to_trajectories"]

TENSOR_KEYS = ("input_ids", "loss_mask", "logprobs", "versions", "attention_mask")


class DistributedBatch(dict):
    """Padded (B, T) tensors of some trajectories, plus `rewards` (B,) and the
    trajectories themselves (`.trajectories`). Keys: input_ids, attention_mask,
    loss_mask, logprobs (behaviour logprobs, 0 off the response), versions (-1 off it),
    rewards."""

    def __init__(self, trajectories: list[Trajectory], pad_token_id: int = 0) -> None:
        super().__init__()
        self.trajectories = list(trajectories)
        if not self.trajectories:
            return
        values = collate(self.trajectories, pad_token_id)
        values["logprobs"] = values.pop("behavior_logprobs")
        versions = torch.full_like(values["input_ids"], -1)
        for row, t in enumerate(self.trajectories):
            v = t.get("token_versions") or [int(t.get("model_version") or 0)] * len(
                t["response_ids"]
            )
            start = len(t["prompt_ids"])
            versions[row, start : start + len(v)] = torch.tensor(v, dtype=versions.dtype)
        values["versions"] = versions
        values["rewards"] = torch.tensor(
            [float(t.get("reward", 0.0)) for t in self.trajectories], dtype=torch.float32
        )
        self.update(values)

    def load_data(self) -> DistributedBatch:
        """The seed's single-controller accessor; the data is already here."""
        return self


def to_trajectories(result: Any, tokenizer: Any = None) -> list[Trajectory] | None:
    """An episode's answer as trajectories: a seed tensor dict, or what nexrl accepts
    (a trajectory dict, a `TokenSample`, a list of them, or None)."""
    if isinstance(result, Mapping) and "input_ids" in result and "prompt_ids" not in result:
        return _from_tensors(result)
    return as_trajectories(result, tokenizer)


def _rows(value: object) -> torch.Tensor:
    t = torch.as_tensor(value)
    return t.unsqueeze(0) if t.dim() == 1 else t


def _from_tensors(out: Mapping[str, object]) -> list[Trajectory]:
    missing = [k for k in ("input_ids", "loss_mask") if k not in out]
    if missing:
        raise KeyError(f"arun_episode's tensor dict lacks {missing}; it has {sorted(out)}")
    ids = _rows(out["input_ids"])
    n, length = ids.shape
    mask = _rows(out.get("attention_mask", torch.ones(n, length)))
    loss = _rows(out["loss_mask"])
    logp = _rows(out.get("logprobs", torch.zeros(n, length)))
    vers = _rows(out.get("versions", torch.zeros(n, length, dtype=torch.long)))
    rewards = torch.as_tensor(out.get("rewards", torch.zeros(n)), dtype=torch.float32).reshape(-1)
    trajs = []
    for b in range(n):
        keep = mask[b].bool()
        row_ids, row_loss = ids[b][keep].tolist(), loss[b][keep].tolist()
        cut = next((i for i, m in enumerate(row_loss) if m), len(row_ids))
        versions = [int(v) for v in vers[b][keep].tolist()[cut:]]
        trajs.append(
            {
                "prompt_ids": row_ids[:cut],
                "response_ids": row_ids[cut:],
                "response_logprobs": [float(x) for x in logp[b][keep].tolist()[cut:]],
                "loss_mask": [int(m) for m in row_loss[cut:]],
                "token_versions": versions,
                "model_version": min(versions) if versions else 0,
                "reward": float(rewards[b if len(rewards) > 1 else 0]),
                "finish_reason": "stop",
            }
        )
    return trajs


class _SeedWorkflow(RolloutWorkflow):
    """Runs a seed workflow against the AReaL engine wrapper and converts its answer."""

    def __init__(self, workflow: Any, engine: Any) -> None:
        self.workflow, self.engine = workflow, engine

    async def arun_episode(self, engine: object, data: Row) -> EpisodeResult:
        result = await self.workflow.arun_episode(self.engine, data)
        return cast(EpisodeResult, to_trajectories(result, getattr(self.engine, "tokenizer", None)))


def as_nexrl_workflow(workflow: Any, engine: Any) -> RolloutWorkflow:
    """`workflow` (anything with `arun_episode`) as a nexrl `RolloutWorkflow` whose
    episodes see `engine` (the AReaL-shaped wrapper) and return trajectories."""
    if not callable(getattr(workflow, "arun_episode", None)):
        raise TypeError(f"{type(workflow).__name__} has no `async arun_episode(engine, data)`")
    return _SeedWorkflow(workflow, engine)


def accept_fn(
    should_accept: Callable[[DistributedBatch], object] | None, pad_token_id: int
) -> Callable[[list[Trajectory]], bool] | None:
    """The seed's `should_accept(x)` (x: the episode's tensors) for the executor, which
    hands over the episode's trajectories."""
    if should_accept is None:
        return None
    return lambda trajs: bool(should_accept(DistributedBatch(trajs, pad_token_id)))
