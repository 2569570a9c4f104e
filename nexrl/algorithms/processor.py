"""Algorithm processors: trajectory batches in, train-ready tensor batches out.

The processor is where algorithm logic lives (STYLE 3): it turns a pool batch
of whole groups into the token-level layout of `nexrl.types` and computes
advantages with a named estimator. The train worker then only adds the train
side's old logprobs and runs the named loss.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import statistics
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from nexrl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from nexrl.algorithms.dapo import mask_truncated, overlong_penalty
from nexrl.algorithms.kl import apply_kl_penalty
from nexrl.config.schema import AlgorithmConfig
from nexrl.execute import execute
from nexrl.module import BLOCKING_GET_WAIT_S, LoopModule, LoopThread
from nexrl.monitoring.samples import sample_rows
from nexrl.protocols import TrainBatchPoolLike, TrainWorkerLike, TrajectoryPoolLike
from nexrl.types import DEFAULT_MODEL_TAG, Batch, Trajectory

logger = logging.getLogger(__name__)

SAMPLE_ROWS = 32  # completions a batch carries for the trackers' sample table (they keep
# `logger.sample_rows` of them, every `logger.sample_every` steps)


Columns = Mapping[str, list]
"""A batch as the pool hands it on (`Batch.values`): one list per trajectory key, one
entry per sample (None where a trajectory lacks the key)."""


def collate(trajectories: list[Trajectory], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded (B, T) tensors of `trajectories` (see `collate_columns`)."""
    return collate_columns(Batch.from_trajectories(trajectories).values, pad_token_id)


def collate_columns(columns: Columns, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded (B, T) tensors: prompt + response, masks and behaviour logprobs.

    Every field's values are laid out flat, row after row, and written into the padded
    array in one masked assignment: a batch is hundreds of short rows, and per-row work
    (tensor ops, or padding lists) costs more than the data."""
    prompts, responses = columns["prompt_ids"], columns["response_ids"]
    logprobs = columns["response_logprobs"]
    given = _column(columns, "loss_mask")
    masks = [m or [1.0] * len(r) for m, r in zip(given, responses, strict=True)]
    _check_lengths(columns, responses, masks, logprobs)
    p_len = np.fromiter(map(len, prompts), np.int64, len(prompts))
    lengths = p_len + np.fromiter(map(len, responses), np.int64, len(responses))
    cols = np.arange(int(lengths.max()))
    valid = cols < lengths[:, None]
    in_response = valid & (cols >= p_len[:, None])
    ids = np.full(valid.shape, pad_token_id, dtype=np.int64)
    ids[valid] = _flat([x for pair in zip(prompts, responses, strict=True) for x in pair], np.int64)
    loss = np.zeros(valid.shape, dtype=np.float32)
    loss[in_response] = _flat(masks, np.float32)
    behavior = np.zeros(valid.shape, dtype=np.float32)
    behavior[in_response] = _flat(logprobs, np.float32)
    return {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(valid).long(),
        "loss_mask": torch.from_numpy(loss),
        "behavior_logprobs": torch.from_numpy(behavior),
    }


def _column(columns: Columns, key: str) -> list:
    """`columns[key]`, or a None per sample when no trajectory has `key`."""
    values = columns.get(key)
    return [None] * _size(columns) if values is None else values


def _size(columns: Columns) -> int:
    return len(next(iter(columns.values()), []))


def _flat(rows: list, dtype: type) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(rows), dtype)


def _check_lengths(columns: Columns, responses: list, masks: list, logprobs: list) -> None:
    """One token count check for the batch; the first bad row is named."""
    n = list(map(len, responses))
    if list(map(len, masks)) == n and list(map(len, logprobs)) == n:
        return
    for i, count in enumerate(n):
        for key, values in (("loss_mask", masks[i]), ("response_logprobs", logprobs[i])):
            if len(values) != count:
                raise ValueError(
                    f"trajectory uid={_column(columns, 'uid')[i]!r}: {key} has {len(values)} "
                    f"entries for {count} response_ids (one per response token)"
                )


def group_index(uids: list[Hashable]) -> torch.Tensor:
    """(N,) long: samples sharing a uid share an index, in order of first appearance."""
    seen: dict[Hashable, int] = {}
    return torch.tensor([seen.setdefault(u, len(seen)) for u in uids], dtype=torch.long)


def episode_index(columns: Columns) -> torch.Tensor | None:
    """(N,) long: the trajectories of one episode share an index. A rollout worker gives
    the trajectories of an episode that made several (an agent episode whose turns did not
    merge) one `episode_id`; any other trajectory is an episode of its own. None when no
    trajectory has an `episode_id` (every trajectory is an episode)."""
    ids = _column(columns, "episode_id")
    if all(e is None for e in ids):
        return None
    seen: dict[Hashable, int] = {}
    pairs = enumerate(zip(columns["uid"], ids, strict=True))
    keys = [i if e is None else (u, e) for i, (u, e) in pairs]
    return torch.tensor([seen.setdefault(k, len(seen)) for k in keys], dtype=torch.long)


def rewards_of(columns: Columns) -> list[float]:
    """Each sample's scalar reward; a clear error naming the first task whose worker set
    none."""
    rewards = _column(columns, "reward")
    if None in rewards:
        uid = _column(columns, "uid")[rewards.index(None)]
        raise ValueError(
            f"trajectory of task {uid!r} has no 'reward': use a rollout worker "
            "with a reward_fn (rollout_worker.type=single_turn) or set it in your worker"
        )
    return [float(r) for r in rewards]


def score_metrics(columns: Columns) -> dict[str, float]:
    """`reward/<name>`: the mean of each named reward component (`scores`) that occurs."""
    scores = [s for s in _column(columns, "scores") if s]
    names = sorted({k for s in scores for k in s})
    return {
        f"reward/{name}": statistics.fmean(float(s[name]) for s in scores if name in s)
        for name in names
    }


def agent_metrics(columns: Columns) -> dict[str, float]:
    """Means over the batch of each multi-turn episode metric (`agent_metrics` of a
    trajectory: turns, tool calls, parse failures, time in the environment, ...)."""
    episodes = [m for m in _column(columns, "agent_metrics") if m]
    names = sorted({k for m in episodes for k in m})
    out = {}
    for name in names:
        nums = [float(m[name]) for m in episodes if isinstance(m.get(name), int | float)]
        if nums:
            out[name if "/" in name else f"agent/{name}"] = statistics.fmean(nums)
    return out


def rollout_metrics(columns: Columns) -> dict[str, float]:
    rewards = rewards_of(columns)
    return {
        **score_metrics(columns),
        **agent_metrics(columns),
        "reward/mean": statistics.fmean(rewards),
        "reward/max": max(rewards),
        "reward/min": min(rewards),
        "response_length/mean": statistics.fmean(map(len, columns["response_ids"])),
        "response/truncated_frac": statistics.fmean(
            r == "length" for r in _column(columns, "finish_reason")
        ),
    }


def async_metrics(columns: Columns, metadata: dict[str, Any]) -> dict[str, float]:
    """Per-batch asynchronous-rollout counts (docs/async.md): stale groups dropped while
    this batch formed, weight-push aborts its groups went through, and samples that were
    continued on newer weights (partial rollout)."""
    aborts = dict(zip(_column(columns, "uid"), _column(columns, "rollout_aborts"), strict=True))
    return {
        "staleness/dropped": float(metadata.get("staleness_dropped", 0)),
        "rollout/aborts": float(sum(int(a or 0) for a in aborts.values())),
        "rollout/partial_continuations": float(
            sum(int(c or 0) for c in _column(columns, "continuations"))
        ),
        "rollout/multi_version_frac": statistics.fmean(
            len(set(v or [])) > 1 for v in _column(columns, "token_versions")
        ),
    }


_TRUNCATED_WARN_FRAC = 0.5
_truncation_warned = False


def warn_if_truncated(columns: Columns, max_tokens: int) -> bool:
    """Warn (once per process) when most completions of a batch hit `max_tokens`: the
    policy is then trained on cut-off answers, usually a `max_tokens` meant for another
    task (the built-in task's 4). True when it warned now."""
    global _truncation_warned
    reasons = _column(columns, "finish_reason")
    frac = sum(r == "length" for r in reasons) / max(1, len(reasons))
    if _truncation_warned or frac <= _TRUNCATED_WARN_FRAC:
        return False
    _truncation_warned = True
    logger.warning(
        "%.0f%% of this batch's completions were cut off at rollout_worker.max_tokens=%d; "
        "raise it to fit your task's answers (the metric response/truncated_frac tracks it)",
        100 * frac,
        max_tokens,
    )
    return True


def min_token_versions(columns: Columns) -> list[int]:
    """Per sample, the oldest weight version that sampled one of its tokens (0 when the
    sample carries no version at all)."""
    model = columns.get("model_version") or [None] * _size(columns)
    return [
        min(v or [0 if m is None else m])
        for v, m in zip(_column(columns, "token_versions"), model, strict=True)
    ]


def source_metadata(batch: Batch) -> dict[str, Any]:
    """What the train worker reads from a train batch's metadata, from the pool batch."""
    return {
        "model_tag": batch.metadata.get("model_tag", DEFAULT_MODEL_TAG),
        "min_token_versions": min_token_versions(batch.values),
        "uids": list(batch.values.get("uid") or []),
    }


def first_rows(columns: Columns, n: int) -> list[Trajectory]:
    """The first `n` samples as trajectories (without building the rest)."""
    return [{k: v[i] for k, v in columns.items()} for i in range(min(n, _size(columns)))]


@dataclass(frozen=True)
class ProcessorContext:
    """What a processor needs from config sections other than `algorithm` and the model."""

    batch_size: int
    max_tokens: int
    pad_token_id: int
    warn_truncated: bool = True
    """Warn when most completions hit `max_tokens` (off on the built-in task, whose
    4-letter answers are cut at 4 tokens by design)."""


T = TypeVar("T")


def _wired(ref: T | None, what: str) -> T:
    """`ref`, set by the wiring (`set_module_references`, `set_activity_tracker`)."""
    if ref is None:
        raise RuntimeError(f"algorithm processor: no {what}; the system wires it before use")
    return ref


class BaseAlgorithmProcessor(LoopModule):
    """Loop: take a batch from the trajectory pool, `_fit` it, put it in the train batch pool.

    A processor written as in seed 000 overrides `_fit(batch, update_fn)` only; it can
    use `collate` (on `batch.to_trajectories()`) or `collate_columns` (on `batch.values`,
    no dict per sample) and `self.pad_token_id` to build the token-level layout.
    """

    def __init__(self, config: AlgorithmConfig, context: ProcessorContext) -> None:
        super().__init__()
        self._config = config
        self._context = context
        self.pad_token_id = context.pad_token_id
        self._trajectory_pool: TrajectoryPoolLike | None = None
        self._train_batch_pool: TrainBatchPoolLike | None = None
        self._train_worker: TrainWorkerLike | None = None
        self._source: Batch | None = None  # the pool batch `_fit` is processing
        self._loop = LoopThread("algorithm-processor", self._loop_once)

    def set_module_references(
        self,
        trajectory_pool: TrajectoryPoolLike,
        train_batch_pool: TrainBatchPoolLike,
        train_worker: TrainWorkerLike | None = None,
    ) -> None:
        """`train_worker` gives reference logprobs for a KL reward penalty."""
        self._trajectory_pool = trajectory_pool
        self._train_batch_pool = train_batch_pool
        self._train_worker = train_worker

    def _loop_once(self) -> bool:
        batch = self._get_batch(self._context.batch_size)
        if batch is None:
            return False
        self._source = batch
        tracker = _wired(self._activity_tracker, "activity tracker")
        with tracker.track(self._module_name, "process batch"):
            self._fit(batch, "train")
        return True

    def _get_batch(self, batch_size: int | None = None) -> Batch | None:
        pool = _wired(self._trajectory_pool, "trajectory pool")
        return execute(pool.get_batch, batch_size, wait_s=BLOCKING_GET_WAIT_S)

    def _put_batch(self, batch: Batch, update_fn: str) -> bool:
        """Hand a train batch on. Metadata the train worker reads and a `_fit` written as in
        seed 000 does not set (`model_tag`, `min_token_versions`, `uids`) is taken from the
        pool batch being processed."""
        source = self._source
        if source is not None:
            for key, value in source_metadata(source).items():
                batch.metadata.setdefault(key, value)
        return execute(
            _wired(self._train_batch_pool, "train batch pool").put_batch, batch, update_fn
        )

    def _fit(self, batch: Batch, update_fn: str) -> None:
        raise NotImplementedError


class GRPOProcessor(BaseAlgorithmProcessor):
    """Group-relative advantages from scalar rewards (any registered estimator).

    Optional reward shaping before the estimator, all off by default:
    DAPO's overlong penalty (`overlong_buffer_len` > 0, against `max_tokens`),
    a KL penalty against the reference model (`kl_in_reward_coef` > 0), and
    DAPO's truncated-completion masking (`mask_truncated`).
    """

    def __init__(self, config: AlgorithmConfig, context: ProcessorContext) -> None:
        super().__init__(config, context)
        self._estimator = ADVANTAGE_ESTIMATORS.get(config.advantage_estimator)
        self._estimator_kwargs = dict(config.advantage_kwargs or {})
        # estimators with group statistics count each episode once (advantages.py)
        params = inspect.signature(self._estimator).parameters
        self._by_episode = "episode_index" in params

    def _shaped_rewards(
        self, columns: Columns, values: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg, extra = self._config, {}
        rewards = torch.tensor(rewards_of(columns))
        if cfg.overlong_buffer_len > 0:
            lengths = torch.tensor(list(map(len, columns["response_ids"])))
            rewards = rewards + overlong_penalty(
                lengths,
                self._context.max_tokens,
                cfg.overlong_buffer_len,
                cfg.overlong_penalty_factor,
            )
        if cfg.kl_in_reward_coef > 0:
            worker = _wired(self._train_worker, "train worker (algorithm.kl_in_reward_coef > 0)")
            ref = execute(worker.compute_ref_logprobs, Batch(dict(values)))
            if ref is None:
                raise ValueError(
                    "algorithm.kl_in_reward_coef > 0 but the train engine has no reference "
                    "model: set train_worker.engine.ref_model_path (a run resolved by "
                    "nexrl.run_setup defaults it to model_path)"
                )
            values["ref_logprobs"] = ref
            rewards, kl = apply_kl_penalty(
                rewards,
                values["behavior_logprobs"],
                ref,
                values["loss_mask"],
                cfg.kl_in_reward_coef,
                cfg.kl_in_reward_estimator,
            )
            extra = {k: float(v) for k, v in kl.items()}
        return rewards, extra

    def _fit(self, batch: Batch, update_fn: str) -> None:
        columns = batch.values  # the pool's batch is columns: no trajectory dict per sample
        values = collate_columns(columns, self.pad_token_id)
        if self._config.mask_truncated:
            values["loss_mask"] = mask_truncated(values["loss_mask"], columns["finish_reason"])
        rewards, shaping_metrics = self._shaped_rewards(columns, values)
        values["rewards"] = rewards
        kwargs = dict(self._estimator_kwargs)
        episodes = episode_index(columns) if self._by_episode else None
        if episodes is not None:
            kwargs["episode_index"] = episodes
        values["advantages"] = self._estimator(
            rewards, group_index(columns["uid"]), values["loss_mask"], **kwargs
        )
        if self._context.warn_truncated:
            warn_if_truncated(columns, self._context.max_tokens)
        metadata = {
            **batch.metadata,
            "model_tag": batch.metadata.get("model_tag", DEFAULT_MODEL_TAG),
            "model_versions": [int(v) for v in columns["model_version"]],
            "min_token_versions": min_token_versions(columns),
            "rollout_metrics": {
                **rollout_metrics(columns),
                **async_metrics(columns, batch.metadata),
                **shaping_metrics,
            },
            "uids": list(columns["uid"]),
            "samples": sample_rows(first_rows(columns, SAMPLE_ROWS), None, limit=SAMPLE_ROWS),
        }
        self._put_batch(Batch(values, metadata), update_fn)
