"""The console backend: a rich progress bar on a terminal, plain lines otherwise.

On a terminal the bar shows step/total, the chosen metrics (their latest values:
a validation post updates `val/reward` without hiding the last train reward),
seconds per step and the ETA. When stdout is not a terminal (a log file, CI, a
pipe) every post prints one plain line instead, because a redrawn bar turns
into noise in a file. Both share `CONSOLE`, so log records routed through
`rich_log_handler()` are printed above the bar instead of through it.

Seconds per step are measured between successive new steps in this process
(a resumed run starts measuring at its first step); the ETA is
`(total_steps - step) * s/step` once `total_steps` is known.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn

if TYPE_CHECKING:
    from nexrl.monitoring.activity import ActivityTracker
    from nexrl.protocols import TaskAdmissionLike, TrajectoryPoolLike

DEFAULT_CONSOLE_KEYS = ("reward/mean", "val/reward", "throughput/samples_per_s")
"""Keys the train worker and the validator emit (`nexrl/training/train_worker.py`,
`nexrl/validation.py`): mean train reward, validation reward, samples per second;
the same list `rl_train.yaml` sets."""

CONSOLE = Console(highlight=False, soft_wrap=True)
"""The one console of this process: the bar and rich log records share it."""


def rich_log_handler(level: int = logging.INFO) -> logging.Handler:
    """A log handler that prints above a live progress bar (use it on a terminal)."""
    from rich.logging import RichHandler

    handler = RichHandler(console=CONSOLE, show_path=False, log_time_format="%H:%M:%S")
    handler.setLevel(level)
    return handler


class ConsoleBackend:
    """Progress for a human: a live bar on a terminal (`live=None` detects it)."""

    def __init__(
        self,
        console_keys: list[str] | None = None,
        live: bool | None = None,
        console: Console | None = None,
        **_: object,
    ) -> None:
        self._console = console or CONSOLE
        self._keys = list(console_keys) if console_keys is not None else list(DEFAULT_CONSOLE_KEYS)
        self.live = self._console.is_terminal if live is None else live
        self.total_steps: int | None = None
        self._first: tuple[int, float] | None = None
        self._latest: dict[str, object] = {}
        self._printed: int | None = None  # last step a plain line was printed for
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    # -- shared by both modes ------------------------------------------------------
    def _rate_parts(self, step: int, now: float) -> list[str]:
        if self._first is None:
            self._first = (step, now)
        first_step, first_t = self._first
        if step <= first_step:
            return []
        per_step = (now - first_t) / (step - first_step)
        parts = [f"{per_step:.2f} s/step"]
        if self.total_steps:
            parts.append(f"ETA {_fmt_duration(max(0, self.total_steps - step) * per_step)}")
        return parts

    def format_line(self, data: Mapping[str, object], step: int, now: float) -> str:
        """The plain line: `step 4/10 | reward/mean 0.5 | 2.00 s/step | ETA 0m12s`."""
        parts = [f"step {step}" + (f"/{self.total_steps}" if self.total_steps else "")]
        parts += [f"{key} {_fmt(data[key])}" for key in self._keys if key in data]
        return " | ".join(parts + self._rate_parts(step, now))

    def format_status(self, data: Mapping[str, object], step: int, now: float) -> str:
        """The text next to the bar: latest value of every key, s/step and ETA."""
        self._latest.update({k: data[k] for k in self._keys if k in data})
        parts = [f"{key} {_fmt(self._latest[key])}" for key in self._keys if key in self._latest]
        return " | ".join(parts + self._rate_parts(step, now))

    # -- backend API ---------------------------------------------------------------
    def log(self, data: Mapping[str, object], step: int) -> None:
        import time

        now = time.monotonic()
        if not self.live:
            shown = any(key in data for key in self._keys)
            if shown or self._printed is None or step > self._printed:  # no bare repeats
                self._console.print(self.format_line(data, step, now), markup=False)
                self._printed = step
            return
        status = self.format_status(data, step, now)
        if self._progress is None and not self._start(step):
            self.live = False  # another live display holds the console: plain lines
            self._console.print(self.format_line(data, step, now), markup=False)
            return
        assert self._progress is not None and self._task is not None
        label = f"step {step}" + (f"/{self.total_steps}" if self.total_steps else "")
        self._progress.update(
            self._task, completed=step, total=self.total_steps, status=status, step=label
        )

    def _start(self, step: int) -> bool:
        from rich.errors import LiveError

        progress = Progress(
            TextColumn("[bold]{task.fields[step]}"),
            BarColumn(),
            TextColumn("{task.fields[status]}", markup=False),
            console=self._console,
            auto_refresh=True,
            refresh_per_second=2,
        )
        self._task = progress.add_task(
            "train", total=self.total_steps, completed=step, status="", step=f"step {step}"
        )
        try:
            progress.start()
        except LiveError:
            return False
        self._progress = progress
        return True

    def log_samples(self, rows: list[dict[str, object]], step: int) -> None:
        """Samples are for the trackers and `samples.jsonl`, not the console."""

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def _fmt_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class StallReporter:
    """Says what a run waits for when no train step has ended for `after_s` seconds.

    `observe(step)` is called from the controller's watch loop with the current train
    step; after `after_s` seconds on one step it logs one warning built by `describe()`
    (which pool group, how many trajectories against how many expected, which worker is
    busy on what, the last error), then again every `after_s` seconds while it lasts.
    `after_s` <= 0 turns it off (`runtime_monitor.stall_report_s`).
    """

    def __init__(
        self,
        after_s: float,
        describe: Callable[[], str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.after_s = after_s
        self._describe = describe
        self._clock = clock
        self._step: int | None = None
        self._since = clock()
        self._reported = self._since

    def observe(self, step: int) -> str | None:
        """The report made now, if any (None: progress, or not yet time)."""
        now = self._clock()
        if step != self._step:
            self._step, self._since, self._reported = step, now, now
            return None
        if self.after_s <= 0 or now - self._reported < self.after_s:
            return None
        self._reported = now
        message = (
            f"no train step for {now - self._since:.0f}s (at step {step}); waiting for: "
            f"{self._describe()} (runtime_monitor.stall_report_s={self.after_s:g})"
        )
        logging.getLogger("nexrl").warning(message)
        return message


def describe_stall(
    pool: TrajectoryPoolLike, admission: TaskAdmissionLike, tracker: ActivityTracker, model_tag: str
) -> str:
    """The state a stall report names: the trajectory pool's groups, the task owner's
    admission, the work in flight (which worker does what) and the last error."""
    from nexrl.execute import execute

    state = execute(admission.snapshot, model_tag)
    running = " ".join(execute(tracker.get_running_status_summary).split())
    health = execute(tracker.get_error_health_status)
    return (
        f"{execute(pool.describe_wait, model_tag)}; admission {state}; {running}; "
        f"last error: {health.get('message', 'none')}"
    )


def task_summary(counters: Mapping[str, int]) -> str:
    """The run's task ledger in one line: every training task handed out was trained,
    counted failed, dropped (by reason) or not finished when the run ended (generating,
    in a pool, or back in its loader); re-queues on the way are counted by reason (a
    re-queued task is served again and ends in one of the other counts)."""
    dropped = {
        k.split("/", 1)[1]: v for k, v in counters.items() if k.startswith("groups_dropped/")
    }
    requeued = {
        k.split("/", 2)[2]: v
        for k, v in counters.items()
        if k.startswith("rollout/released/") and k != "rollout/released/dynamic_sampling"
    }
    staleness = counters.get("staleness/dropped", 0)
    if staleness:
        requeued["stale"] = staleness

    def detail(parts: dict[str, int]) -> str:
        return f" ({', '.join(f'{k} {v}' for k, v in sorted(parts.items()))})" if parts else ""

    handed = counters.get("tasks_in/train", 0)
    trained, failed = counters.get("tasks_trained", 0), counters.get("tasks_failed/train", 0)
    left = handed - trained - failed - sum(dropped.values())
    return (
        f"tasks: {handed} handed out; {trained} trained, {failed} failed, "
        f"{sum(dropped.values())} dropped{detail(dropped)}, {left} not finished at the end; "
        f"{sum(requeued.values())} re-queued on the way{detail(requeued)}"
    )
