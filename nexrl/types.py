"""Core data types shared by every nexrl module.

`Trajectory` is a plain dict so that user rollout code can add any key it
likes; the keys nexrl itself reads are listed in `TRAJECTORY_KEYS` and
`check_trajectory` names the first one missing. `Task` is one unit of work
from a data loader with its bookkeeping (retries, aborts, partial samples) in
typed fields; `StepResult` is what a rollout step answers.

`Batch` carries either per-trajectory lists (as it leaves the trajectory pool)
or padded token-level tensors (as it leaves the algorithm processor). The
token-level layout every trainer understands is:

    input_ids          (B, T) long   prompt + response, right padded
    attention_mask     (B, T) long   1 on real tokens
    loss_mask          (B, T) float  1 on tokens the policy produced
    advantages         (B, T) float
    behavior_logprobs  (B, T) float  engine logprob of each token (0 off-mask)
    old_logprobs       (B, T) float  trainer logprob before the update
    ref_logprobs       (B, T) float  optional, reference model

Per-token tensors are aligned with `input_ids`: entry `t` belongs to token
`t`, and its logprob is `log p(input_ids[t] | input_ids[:t])` (0 at t = 0).
Keeping every tensor the same shape makes packing, multi-turn masks and
padding removal one operation instead of three.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import ItemsView, KeysView
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeAlias, TypedDict

import torch

if TYPE_CHECKING:
    from nexrl.inference.protocol import CompletionResult

ModelTag = str
Trajectory = dict[str, Any]

JSONValue: TypeAlias = "str | int | float | bool | None | list[JSONValue] | dict[str, JSONValue]"
"""A value that survives `json.dumps` / `json.loads` unchanged (request bodies, rows read
from JSON files, tool arguments)."""
JSONDict: TypeAlias = "dict[str, JSONValue]"


class LoaderState(TypedDict, total=False):
    """The loader part of a checkpoint's run state."""

    dataloader: JSONDict | None
    """The loader's `state_dict()` (left out, or None, for a loader that keeps none)."""


class PendingTasks(LoaderState):
    """`TaskAdmission.checkpoint_state`: the loader's own state and the handed-out tasks
    not trained yet (`nexrl.data.base.item_to_state`), saved with a checkpoint."""

    pending_tasks: list[JSONDict]


class SampleRow(TypedDict):
    """One row of the sample-completion table the trackers receive (`SAMPLE_COLUMNS`)."""

    prompt: str
    response: str
    reward: float | None
    version: int | None
    staleness: int | None


DEFAULT_MODEL_TAG: ModelTag = "default"

TRAJECTORY_KEYS = (
    "uid",
    "prompt_ids",
    "response_ids",
    "response_logprobs",
    "loss_mask",
    "reward",
    "finish_reason",
    "model_tag",
    "model_version",
)


class StepResult(str, Enum):
    """What `BaseRolloutWorker.step` answers (a `str` enum: user code may return the string).

    SUCCESS   the trajectories were accepted (pool or validator)
    REROLL    generate the task again now ("re-rollout"): it goes back to the front
    FAIL      the task could not become trajectories: retried, then counted as failed
    ABORTED   a weight push aborted the generation: back to the front of the loader
    DEFERRED  aborted too often: held in the tail-batch candidate pool
    DROPPED   dropped on purpose (DAPO dynamic sampling); counted
    """

    SUCCESS = "success"
    REROLL = "re-rollout"
    FAIL = "fail"
    ABORTED = "aborted"
    DEFERRED = "deferred"
    DROPPED = "dropped"

    @classmethod
    def of(cls, value: StepResult | str | None) -> StepResult:
        """`None` (the seed's "failed before a trajectory existed") is FAIL."""
        if value is None:
            return cls.FAIL
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"rollout step returned {value!r}; valid: {[r.value for r in cls]} or None"
            ) from None


@dataclass
class Task:
    """One data row on its way through the rollout side, with its bookkeeping.

    `data` is the loader's row exactly (what `step` receives); everything nexrl
    tracks about the task lives in the other fields, never inside `data`.
    """

    data: JSONDict
    task_id: int = -1
    """Unique per run, set when the task is first handed out (-1: not yet)."""
    is_validate: bool = False
    retries: int = 0
    """Failed attempts so far (bounded by `rollout_worker.max_task_retries`)."""
    aborts: int = 0
    """Times a weight push aborted this task's generation."""
    partial: list[CompletionResult] | None = None
    """Samples kept from an aborted generation (partial rollout), continued next time."""
    tail: bool = False
    """Served from the tail-batch pool: never aborted again."""

    @property
    def uid(self) -> JSONValue:
        return self.data.get("uid")

    # Read access to the row, so a `step(task)` written for the row dict (seed 000:
    # `task["prompt"]`, `task.get(...)`, `"prompt" in task`) works on the Task itself.
    def __getitem__(self, key: str) -> JSONValue:
        return self.data[key]

    def __contains__(self, key: object) -> bool:
        return key in self.data

    def get(self, key: str, default: JSONValue = None) -> JSONValue:
        return self.data.get(key, default)

    def keys(self) -> KeysView[str]:
        return self.data.keys()

    def items(self) -> ItemsView[str, JSONValue]:
        return self.data.items()


REQUIRED_TRAJECTORY_KEYS = ("uid", "prompt_ids", "response_ids", "response_logprobs")


def check_trajectory(trajectory: Trajectory) -> None:
    """Raise ValueError naming each key a trainable trajectory lacks (and what fills it)."""
    missing = [k for k in REQUIRED_TRAJECTORY_KEYS if trajectory.get(k) is None]
    if missing:
        raise ValueError(
            f"trajectory is missing {missing} (has {sorted(trajectory)}); the pool needs "
            f"{list(REQUIRED_TRAJECTORY_KEYS)}: take the ids and logprobs from the client's "
            "result (docs/rollout.md)"
        )


class NexRLRole(Enum):
    """Roles a module can play; the Ray resource manager maps roles to actors."""

    ROLLOUT_WORKER = "rollout_worker"
    TRAIN_WORKER = "train_worker"
    ALGORITHM_PROCESSOR = "algorithm_processor"
    TRAJECTORY_POOL = "trajectory_pool"
    TRAIN_BATCH_POOL = "train_batch_pool"
    WEIGHT_SYNC_CONTROLLER = "weight_sync_controller"
    TASK_ADMISSION = "task_admission"
    DATA_LOADER = "data_loader"
    VALIDATE_DATALOADER = "validate_dataloader"
    VALIDATOR = "validator"


@dataclass
class Batch:
    """A batch of samples: `values` has one entry per sample in each field."""

    values: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if "batch_size" not in self.metadata:
            self.metadata["batch_size"] = _infer_batch_size(self.values)

    def __len__(self) -> int:
        return int(self.metadata["batch_size"])

    def copy(self) -> Batch:
        return Batch(values=copy.deepcopy(self.values), metadata=copy.deepcopy(self.metadata))

    def to_dict(self) -> dict[str, Any]:
        """One flat dict; metadata keys win over value keys of the same name."""
        return {**self.values, **self.metadata}

    @classmethod
    def from_trajectories(cls, trajectories: list[Trajectory], **metadata: Any) -> Batch:
        """Columns of `trajectories`: every key any of them has (first-seen order), None
        where one lacks it."""
        metadata = {"batch_size": len(trajectories), **metadata}
        shape = trajectories[0].keys() if trajectories else None
        if shape is not None and len(shape) > 1 and all(t.keys() == shape for t in trajectories):
            keys = list(shape)  # the usual batch, one shape: a tuple per row, then transposed
            columns = zip(*map(operator.itemgetter(*keys), trajectories), strict=True)
            return cls(dict(zip(keys, map(list, columns), strict=True)), metadata)
        names = dict.fromkeys(k for traj in trajectories for k in traj)
        return cls({k: [traj.get(k) for traj in trajectories] for k in names}, metadata)

    def to_trajectories(self) -> list[Trajectory]:
        return [{k: v[i] for k, v in self.values.items()} for i in range(len(self))]

    def select(self, indices: list[int]) -> Batch:
        """A new batch with the samples at `indices` (tensors and lists alike)."""
        values: dict[str, Any] = {}
        for k, v in self.values.items():
            if isinstance(v, torch.Tensor):
                values[k] = v[torch.as_tensor(indices, dtype=torch.long)]
            else:
                values[k] = [v[i] for i in indices]
        return Batch(values, {**copy.deepcopy(self.metadata), "batch_size": len(indices)})

    @staticmethod
    def remove_redundant_left_padding(
        data: Batch,
        pad_token_id: int,
        fields: list[str] | None = None,
        anchor_field: str = "input_ids",
        max_strip_threshold: int | None = None,
    ) -> Batch:
        """Drop leading columns that are padding in every row of `anchor_field`."""
        anchor = data.values[anchor_field]
        n = _common_pad_run(anchor, pad_token_id, from_left=True, cap=max_strip_threshold)
        return _strip(data, n, fields, anchor_field, from_left=True)

    @staticmethod
    def remove_redundant_right_padding(
        data: Batch,
        pad_token_id: int,
        fields: list[str] | None = None,
        anchor_field: str = "input_ids",
        max_strip_threshold: int | None = None,
    ) -> Batch:
        """Drop trailing columns that are padding in every row of `anchor_field`."""
        anchor = data.values[anchor_field]
        n = _common_pad_run(anchor, pad_token_id, from_left=False, cap=max_strip_threshold)
        return _strip(data, n, fields, anchor_field, from_left=False)

    def to_nextrainer_batch(self) -> dict[str, Any]:
        """Split into tensor values, non-tensor values and metadata."""
        tensors = {k: v for k, v in self.values.items() if isinstance(v, torch.Tensor)}
        others = {k: v for k, v in self.values.items() if not isinstance(v, torch.Tensor)}
        return {"batch": tensors, "non_tensor_batch": others, "meta_info": dict(self.metadata)}


def _infer_batch_size(values: dict[str, Any]) -> int:
    for v in values.values():
        if isinstance(v, torch.Tensor):
            return int(v.shape[0])
        if isinstance(v, list | tuple):
            return len(v)
    return 0


def _common_pad_run(anchor: torch.Tensor, pad: int, from_left: bool, cap: int | None) -> int:
    """Number of columns at one end that are `pad` in every row."""
    is_pad_col = (anchor == pad).all(dim=0)  # (T,)
    if not from_left:
        is_pad_col = is_pad_col.flip(0)
    not_pad = (~is_pad_col).nonzero()
    n = int(not_pad[0]) if len(not_pad) else anchor.shape[1]
    return min(n, cap) if cap is not None else n


def _strip(
    data: Batch, n: int, fields: list[str] | None, anchor_field: str, from_left: bool
) -> Batch:
    out = data.copy()
    if n == 0:
        return out
    names = fields if fields is not None else [anchor_field]
    for name in names:
        t = out.values[name]
        out.values[name] = t[:, n:] if from_left else t[:, : t.shape[1] - n]
    return out
