"""Rewinding a Ray run to its last checkpoint after a module actor restarted.

Why a rewind and not an in-place repair: every actor holds state the others
cannot rebuild. In the default layout the `rollout` actor holds the task ledger
(`TaskAdmission`: tasks generating, pooled, in formed batches, tail candidates),
the engine's weights, the loader position and the trajectory pool; the `train`
actor holds the optimizer state and the train batch pool (whose loss leaves holes
in the batch numbering the trainer and the ledger share). The three-actor
`SPLIT_COLOCATION` moves the loaders and pools to a `data` actor of their own.
A checkpoint already stores all of it consistently (weights, optimizer, loader
state and the tasks handed out but not trained, taken in one critical section),
and resuming from it is tested to train every item exactly once. So a restart
rewinds the running system to that checkpoint, as AReaL's recover mode does, but
in place: no process exits, surviving actors and their engines stay up, and only
the work since the checkpoint is redone.

Order (the restarted actor is fenced from its rebuild until step 3, so no module
reads its fresh state and no checkpoint is written from it):

    1. pause every module loop; wait until no tracked work is in flight
    2. lift the fence of the restarted actors
    3. empty the pools and the validator; reset the task ledger
    4. restore the checkpoint (weights, optimizer, step, loader, pending tasks;
       the weights are pushed as version `step`)
    5. forget the errors the fenced calls raised; run the loops again
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from nexrl.execute import execute

if TYPE_CHECKING:
    from nexrl.system import ModuleSystem

logger = logging.getLogger(__name__)


class ActorRestartedError(RuntimeError):
    """A call reached a module of a restarted (fenced) Ray actor before the rewind."""


def describe(restarted: dict[str, list[str]]) -> str:
    """`data (data_loader_0, trajectory_pool_0)`, for log lines and errors."""
    return "; ".join(f"{group} ({', '.join(keys)})" for group, keys in restarted.items())


def quiesce_and_reset(
    system: ModuleSystem, restarted: dict[str, list[str]], timeout: float = 60.0
) -> None:
    """Steps 1-3: every loop stopped, the fence lifted, no run state left in any module."""
    for module in reversed(system.loops()):
        execute(module.pause)
    system.flush_tracker()  # every bracket of the stopped loops is on record
    tracker = system.activity_tracker
    if not execute(tracker.wait_quiescent, timeout):
        raise RuntimeError(
            f"rewind after the restart of {describe(restarted)}: modules still busy after "
            f"{timeout:.0f} s: {execute(tracker.get_running_status_summary)}"
        )
    system.unfence(list(restarted))
    execute(system.trajectory_pool.clear)
    execute(system.train_batch_pool.clear)
    execute(system.validator.clear)
    for worker in system.rollout_workers:
        execute(worker.end_validate)
    execute(system.task_admission.reset)
    execute(system.weight_sync_controller.reset)


def restart_loops(system: ModuleSystem) -> None:
    """Step 5: errors raised by calls into the fenced actor are forgotten, loops restart."""
    tracker = system.activity_tracker
    health = execute(tracker.get_error_health_status)
    if health.get("recent_error_count"):
        logger.warning("forgetting errors raised while an actor was fenced: %s", health["message"])
    execute(tracker.clear_errors)
    system.start()
