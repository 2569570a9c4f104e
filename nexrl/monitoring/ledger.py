"""The task ledger across a resume: its counts travel in the checkpoint.

The end-of-run line (`progress.task_summary`) reads the activity tracker's counters,
which live as long as the process. A run resumed with `resume.mode=auto` starts with
an empty tracker, so without help its line would cover only the tasks of the resumed
part. The train worker therefore writes the ledger's counts into each checkpoint,
taken right after the loader position and the pending tasks (`checkpoint_ledger`),
and the controller adds them back before a resumed run starts (`restore_ledger`).

What a checkpoint keeps is the settled part of the ledger: trained, failed and
dropped tasks and the re-queues on the way. The tasks not finished at the save are
not kept: the same checkpoint's pending tasks and loader position hand them out again
after the resume, where they are counted. So `tasks_in/train` is saved as the sum of
the settled counts, and the line after the resume covers the whole run with every
task handed out once. (Counts sent from other processes reach the tracker within one
outbox batch, nexrl/monitoring/outbox.py: a task settled in the last milliseconds
before a save may be counted both before it and after the resume, never lost.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from nexrl.execute import execute

if TYPE_CHECKING:
    from nexrl.monitoring.activity import ActivityTracker

SETTLED = ("tasks_trained", "tasks_failed/train", "staleness/dropped")
SETTLED_PREFIXES = ("groups_dropped/", "rollout/released/")
HANDED_OUT = "tasks_in/train"


def checkpoint_ledger(counters: Mapping[str, int]) -> dict[str, int]:
    """The ledger counts a checkpoint keeps (see the module docstring)."""
    kept = {
        k: int(v) for k, v in counters.items() if k in SETTLED or k.startswith(SETTLED_PREFIXES)
    }
    dropped = sum(v for k, v in kept.items() if k.startswith("groups_dropped/"))
    kept[HANDED_OUT] = kept.get("tasks_trained", 0) + kept.get("tasks_failed/train", 0) + dropped
    return kept


def restore_ledger(tracker: ActivityTracker, saved: Mapping[str, int] | None) -> dict[str, int]:
    """Add a checkpoint's ledger counts to `tracker` (a resumed run, before it starts);
    returns what was added (nothing for a checkpoint written before ledgers were kept)."""
    added = {k: int(v) for k, v in (saved or {}).items() if int(v)}
    for key, value in added.items():
        execute(tracker.increment, key, value)
    return added
