"""The asynchronous sample policy: how many rollouts may run, and which samples are too old.

Pure bookkeeping, no threads and no I/O, so that it can be property-tested
over random schedules; `WeightSyncController` holds one `AdmissionLedger` per
model tag behind its lock and calls these methods in this order:

    acquire()            a rollout group asks to START (False: wait and ask again)
    release()            the group will never land in a batch (failed, re-rolled,
                         aborted, deferred to the tail pool, dropped as stale)
    batch_formed(n)      the trajectory pool cut batch `formed` out of n groups
    set_version(v)       new weights (trained for v steps) serve rollouts

Definitions (docs/async.md): batch j trains at step j; the weights after j
steps have version j, so a sample started on version v and trained in batch j
has staleness j - v. A group admitted now lands (at the earliest) in batch
`formed + outstanding // groups_per_batch`; admission requires that landing
batch to be within `staleness_threshold` k of the serving version:

    formed + outstanding // gpb - version <= k

i.e. `outstanding < capacity = (k + 1 - (formed - version)) * gpb`, plus
`ceil(over_sample_threshold * gpb)` extra groups (xtuner's over-sending).
Groups can finish out of order and over-sent groups can land later than
planned, so the pool re-checks every group when its batch forms
(`is_stale`) and drops the stale ones: the bound is strict, admission only
keeps the drops rare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nexrl.config.schema import WeightConfig

SYNC_MODES = ("sync", "batch-async", "fully-async")


@dataclass(frozen=True)
class SamplePolicy:
    """The knobs of `weight.*` that shape rollout admission (see docs/async.md)."""

    sync_mode: str = "sync"
    staleness_threshold: int = 0
    over_sample_threshold: float = 0.0
    enable_partial_rollout: bool = False
    inflight_weight_update: bool = False
    tail_batch_candidate_steps: int = 0
    tail_batch_trigger_size: int = 0
    sync_every: int = 1
    abort_grace_s: float = 0.0
    groups_per_batch: int | None = None  # None: admission off (unit tests of the sync gate)

    @classmethod
    def from_config(
        cls, config: WeightConfig, groups_per_batch: int | None, inflight_capable: bool = True
    ) -> SamplePolicy:
        """The policy of the `weight.*` section; `groups_per_batch` is the pool's
        `batch_size // group_size` (None: admission off, for unit tests only).
        `inflight_weight_update: null` becomes true in fully-async when the engine can
        swap weights under running requests (`inflight_capable`), else false."""
        mode = config.sync_mode
        if mode not in SYNC_MODES:
            raise ValueError(f"weight.sync_mode={mode!r}; valid choices: {', '.join(SYNC_MODES)}")
        inflight = resolve_inflight(config, inflight_capable)
        policy = cls(
            sync_mode=mode,
            staleness_threshold=0 if mode == "sync" else config.staleness_threshold,
            over_sample_threshold=config.over_sample_threshold,
            enable_partial_rollout=resolve_partial(config, inflight),
            inflight_weight_update=inflight,
            tail_batch_candidate_steps=config.tail_batch_candidate_steps,
            tail_batch_trigger_size=config.tail_batch_trigger_size,
            sync_every=1 if mode == "sync" else config.sync_every,
            abort_grace_s=config.abort_grace_s,
            groups_per_batch=groups_per_batch,
        )
        policy.check()
        return policy

    def check(self) -> None:
        bad = {
            "staleness_threshold": self.staleness_threshold < 0,
            "over_sample_threshold": self.over_sample_threshold < 0,
            "tail_batch_candidate_steps": self.tail_batch_candidate_steps < 0,
            "tail_batch_trigger_size": self.tail_batch_trigger_size < 0,
            "sync_every": self.sync_every < 1,
            "abort_grace_s": self.abort_grace_s < 0,
        }
        for key, wrong in bad.items():
            if wrong:
                raise ValueError(f"weight.{key}={getattr(self, key)} is out of range")
        if self.inflight_weight_update and self.sync_mode != "fully-async":
            raise ValueError(
                "weight.inflight_weight_update=true needs weight.sync_mode=fully-async "
                f"(got {self.sync_mode!r}: its pushes never meet running requests)"
            )
        if self.groups_per_batch is not None and self.groups_per_batch < 1:
            raise ValueError(f"groups_per_batch must be >= 1, got {self.groups_per_batch}")

    @property
    def extra_groups(self) -> int:
        """Over-sent groups allowed in flight beyond the staleness budget."""
        if self.groups_per_batch is None:
            return 0
        return math.ceil(self.over_sample_threshold * self.groups_per_batch)

    @property
    def tail_trigger(self) -> int:
        """Candidates that trigger a tail batch (0 in config: one batch worth of groups)."""
        return self.tail_batch_trigger_size or (self.groups_per_batch or 1)


def resolve_inflight(config: WeightConfig, capable: bool) -> bool:
    """`weight.inflight_weight_update: null` is on in fully-async when the engine can swap
    weights under running requests, unless partial rollout or the tail batch is asked
    for: both act on aborted requests, so asking for them asks for aborts."""
    if config.inflight_weight_update is not None:
        return bool(config.inflight_weight_update)
    wants_aborts = bool(config.enable_partial_rollout) or config.tail_batch_candidate_steps > 0
    return config.sync_mode == "fully-async" and capable and not wants_aborts


def resolve_partial(config: WeightConfig, inflight: bool) -> bool:
    """`weight.enable_partial_rollout: null` is on when fully-async pushes abort running
    requests (`inflight`: the resolved in-flight setting): an aborted sample then goes
    on from its tokens instead of starting over. Restarting every group a push finds
    running made fully-async 0.94-0.97x sync on the long-tail task with the emulated
    accelerator, continuing it 1.08-1.15x (docs/async.md)."""
    if config.enable_partial_rollout is not None:
        return bool(config.enable_partial_rollout)
    return config.sync_mode == "fully-async" and not inflight


@dataclass
class AdmissionLedger:
    """Counts for one model tag: batches formed, serving version, groups outstanding."""

    policy: SamplePolicy
    formed: int = 0  # index of the next batch the pool will form
    version: int = 0  # train steps of the weights serving rollouts
    outstanding: int = 0  # admitted groups not yet in a formed batch

    def capacity(self) -> int | None:
        """Groups that may be outstanding now (None: unbounded, admission off)."""
        gpb = self.policy.groups_per_batch
        if gpb is None:
            return None
        lag = self.formed - self.version
        return max(0, (self.policy.staleness_threshold + 1 - lag) * gpb) + self.policy.extra_groups

    def room(self) -> float:
        """Groups that may be admitted now (inf: admission off)."""
        cap = self.capacity()
        return math.inf if cap is None else cap - self.outstanding

    def acquire(self) -> bool:
        if self.room() <= 0:
            return False
        self.outstanding += 1
        return True

    def release(self, n: int = 1) -> None:
        """Groups put without admission (unit tests, custom workers) count as zero."""
        self.outstanding = max(0, self.outstanding - n)

    def batch_formed(self, n_groups: int) -> int:
        """Account batch `formed` (n groups); returns its index."""
        index = self.formed
        self.formed += 1
        self.outstanding = max(0, self.outstanding - n_groups)
        return index

    def set_version(self, version: int) -> None:
        self.version = version

    def is_stale(self, min_version: int, batch_index: int | None = None) -> bool:
        """Would a sample whose oldest token came from `min_version` break the bound?"""
        index = self.formed if batch_index is None else batch_index
        return index - min_version > self.policy.staleness_threshold
