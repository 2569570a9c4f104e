"""Activity tracking: what work is in flight, module liveness, counters, logging.

One central `ActivityTracker` lives with the controller; every module holds an
`ActivityTrackerProxy` that reaches it through `execute`, so the same code
works when the tracker is a Ray actor. Work is bracketed by `start` -> token ->
`end(token)`; modules use `proxy.track(module, work)` which does both and
reports an escaping exception before re-raising it (the error is recorded,
never swallowed).

Quiescence is a view of brackets, not of tasks: a worker takes its task just
before it enters `track`, and in Ray mode the bracket's calls travel batched
(nexrl/monitoring/outbox.py). Where the answer must be exact the task ledger
decides (the trajectory pool's end of data, `TaskAdmission.end_of_data`; the
run's end, `TaskAdmission.pending_count`), and the end of the run and a Ray rewind flush every
process's queued calls (`system.flush_tracker()`) before they ask. The `module` string
given to `track` must be the name passed to `register_module` for
`is_rollout_worker_quiescent` to see it.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from nexrl.execute import execute, execute_within, is_remote
from nexrl.monitoring.errors import ErrorReporter, ErrorSeverity, HealthStatus
from nexrl.monitoring.loggers import ExperimentLogger, PostOptions, check_backend
from nexrl.monitoring.outbox import QUEUED, QueuedCall, outbox_for

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from typing_extensions import Unpack

    from nexrl.protocols import ModuleLike

logger = logging.getLogger(__name__)
_PROCESS = os.urandom(4).hex()  # tokens made by proxies are unique across processes
_TOKENS = itertools.count()


def _get(config: Any, dotted: str, default: Any = None) -> Any:
    node = config
    for part in dotted.split("."):
        if node is None:
            return default
        node = node.get(part) if hasattr(node, "get") else None
    return default if node is None else node


def build_experiment_logger(config: DictConfig | Mapping[str, object]) -> ExperimentLogger:
    """From the root config: `logger.{backend,run_dir,console_keys}`, project/experiment
    names and `train_worker.total_train_steps` (the console's ETA)."""
    keys = _get(config, "logger.console_keys")
    tree = OmegaConf.to_container(config, resolve=True) if OmegaConf.is_config(config) else None
    run_config = {str(k): v for k, v in tree.items()} if isinstance(tree, dict) else None
    return ExperimentLogger(
        backends=_get(config, "logger.backend"),
        run_dir=_get(config, "logger.run_dir"),
        project_name=_get(config, "project_name", "nexrl"),
        experiment_name=_get(config, "experiment_name"),
        total_steps=_get(config, "train_worker.total_train_steps"),
        console_keys=list(keys) if keys is not None else None,
        run_config=run_config,
        sample_every=_get(config, "logger.sample_every", 10),
        sample_rows=_get(config, "logger.sample_rows", 8),
        tracking_uri=_get(config, "logger.mlflow_tracking_uri"),
    )


class ActivityTracker:
    """Central, thread-safe record of in-flight work, errors, counters and the train step."""

    def __init__(
        self,
        config: DictConfig | Mapping[str, object] | None = None,
        max_errors: int = 1000,
        experiment_logger: ExperimentLogger | None = None,
    ) -> None:
        self._cond = threading.Condition()
        self._inflight: dict[str, tuple[str, str, float]] = {}  # token -> (module, work, t0)
        self._ids = itertools.count()
        self._module_refs: dict[str, ModuleLike] = {}
        self._rollout_workers: set[str] = set()
        self._dead_modules: list[str] = []
        self._counters: dict[str, int] = {}
        self._training_step = 0
        self.error_reporter = ErrorReporter(max_errors=max_errors)
        self.experiment_logger = experiment_logger or build_experiment_logger(config or {})

    # ---- activity -------------------------------------------------------
    def start(self, module: str, work: str, token: str | None = None) -> str:
        """Record `work` of `module` in flight; `token`: the caller's own unique name for
        it (a proxy queueing its calls names it), else one is made."""
        token = token or f"{module}:{next(self._ids)}"
        with self._cond:
            self._inflight[token] = (module, work, time.monotonic())
        return token

    def end(self, token: str) -> None:
        with self._cond:
            if self._inflight.pop(token, None) is None:
                raise ValueError(f"ActivityTracker.end: unknown or already ended token {token!r}")
            self._cond.notify_all()

    def apply(self, calls: list[QueuedCall]) -> None:
        """Run a batch of queued calls, `(method, args)` or `(method, args, kwargs)`, in
        order (an `Outbox` sends them; `QUEUED` names the methods)."""
        for method, args, *rest in calls:
            if method not in QUEUED:
                raise ValueError(f"ActivityTracker.apply: {method!r} cannot be queued")
            try:
                getattr(self, method)(*args, **(rest[0] if rest else {}))
            except ValueError as exc:  # one bad token must not lose the rest of the batch
                logger.warning("tracker: queued %s%r failed: %s", method, args, exc)
            except Exception as exc:  # e.g. a logger backend failed: on record, batch goes on
                self.report_exception("activity_tracker", f"queued {method}", exc)

    def is_quiescent(self) -> bool:
        with self._cond:
            return not self._inflight

    def wait_quiescent(self, timeout: float | None = None) -> bool:
        """Block until no work is in flight; False if `timeout` seconds pass first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._inflight, timeout=timeout)

    def forget_module(self, module: str) -> int:
        """Drop `module`'s in-flight work (its process died and restarted); returns the count."""
        with self._cond:
            gone = [t for t, (m, _, _) in self._inflight.items() if m == module]
            for token in gone:
                del self._inflight[token]
            self._cond.notify_all()
        return len(gone)

    def get_running_status_summary(self) -> str:
        now = time.monotonic()
        with self._cond:
            items = sorted(self._inflight.values(), key=lambda x: x[2])
        if not items:
            return "quiescent: no work in flight"
        lines = [f"{len(items)} work item(s) in flight:"]
        lines += [f"  {m}: {w} ({now - t0:.1f}s)" for m, w, t0 in items]
        return "\n".join(lines)

    # ---- modules --------------------------------------------------------
    def register_module(
        self, module_name: str, module_ref: ModuleLike, is_rollout_worker: bool = False
    ) -> None:
        with self._cond:
            self._module_refs[module_name] = module_ref
            if is_rollout_worker:
                self._rollout_workers.add(module_name)

    def is_rollout_worker_quiescent(self) -> bool:
        with self._cond:
            return not any(m in self._rollout_workers for m, _, _ in self._inflight.values())

    def check_module_liveness(self, timeout: float = 5.0) -> bool:
        """Call every registered module's `health_check`; raising or False = dead."""
        with self._cond:
            refs = dict(self._module_refs)
        dead = []
        for name, ref in refs.items():
            try:
                alive = execute_within(timeout, ref.health_check)
            except Exception as exc:  # a dead module is the answer, not an error here
                logger.warning("module %s failed its health check: %r", name, exc)
                alive = False
            if not alive:
                dead.append(name)
        with self._cond:
            self._dead_modules = dead
        return not dead

    def get_dead_modules(self) -> list[str]:
        """Modules found dead by the last `check_module_liveness` call."""
        with self._cond:
            return list(self._dead_modules)

    # ---- errors ---------------------------------------------------------
    def report_exception(
        self,
        module: str,
        work: str,
        exception: BaseException,
        severity: ErrorSeverity | None = None,
        details: dict[str, object] | None = None,
    ) -> str:
        return self.error_reporter.report_exception(
            module, work, exception, severity or ErrorSeverity.ERROR, details
        )

    def report_error(
        self,
        module: str,
        work: str,
        message: str,
        severity: ErrorSeverity | None = None,
        details: dict[str, object] | None = None,
    ) -> str:
        return self.error_reporter.report_error(
            module, work, message, severity or ErrorSeverity.ERROR, details
        )

    def get_error_health_status(self) -> HealthStatus:
        return self.error_reporter.get_health_status()

    def clear_errors(self) -> None:
        """Forget the reported errors (after a Ray rewind: they came from fenced calls)."""
        self.error_reporter.clear()

    # ---- counters, step, logging -----------------------------------------
    def increment(self, name: str, n: int = 1) -> int:
        with self._cond:
            self._counters[name] = self._counters.get(name, 0) + n
            return self._counters[name]

    def get_counters(self) -> dict[str, int]:
        with self._cond:
            return dict(self._counters)

    def set_training_step(self, step: int) -> None:
        with self._cond:
            self._training_step = int(step)
        self.error_reporter.note_progress()  # errors before a step are not consecutive

    def get_training_step(self) -> int:
        with self._cond:
            return self._training_step

    def experiment_logger_post(self, backend: str, **kwargs: Unpack[PostOptions]) -> None:
        """Forward to `ExperimentLogger.post`; `step` defaults to the training step."""
        kwargs.setdefault("step", self.get_training_step())
        self.experiment_logger.post(backend, **kwargs)

    def close(self) -> None:
        self.experiment_logger.close()


class ActivityTrackerProxy:
    """What a module holds: forwards to the central tracker through `execute`.

    With a Ray tracker, `start`, `end`, `increment`, `set_training_step` and
    `experiment_logger_post` go through this process's `Outbox` (batched, in order, not
    waited for); the proxy's reads flush it first."""

    def __init__(self, central_tracker: ActivityTracker) -> None:
        self._central = central_tracker

    def _queue(self, method: str, *args: object, **kwargs: object) -> None:
        if is_remote(self._central.apply):
            outbox_for(self._central).put(method, *args, **kwargs)
        else:
            getattr(self._central, method)(*args, **kwargs)

    def _flush(self) -> None:
        if is_remote(self._central.apply):
            outbox_for(self._central).flush()

    @contextmanager
    def track(self, module: str, work: str, auto_report_errors: bool = True) -> Iterator[None]:
        """Mark `work` in flight; an exception is reported (if asked) and re-raised."""
        if is_remote(self._central.apply):  # queued: see nexrl/monitoring/outbox.py
            token = f"{module}:{_PROCESS}:{next(_TOKENS)}"
            self._queue("start", module, work, token)
        else:
            token = self._central.start(module, work)
        try:
            yield
        except Exception as exc:
            if auto_report_errors:
                execute(self._central.report_exception, module, work, exc)
            raise
        finally:
            self._queue("end", token)

    def is_quiescent(self) -> bool:
        self._flush()
        return execute(self._central.is_quiescent)

    def is_rollout_worker_quiescent(self) -> bool:
        self._flush()
        return execute(self._central.is_rollout_worker_quiescent)

    def report_exception(self, module: str, work: str, exception: BaseException, severity=None):
        return execute(self._central.report_exception, module, work, exception, severity)

    def report_error(self, module: str, work: str, message: str, severity=None, details=None):
        return execute(self._central.report_error, module, work, message, severity, details)

    def increment(self, name: str, n: int = 1) -> None:
        """Not waited for (counted per task in the hot path); other processes'
        `get_counters` may lag a count by one outbox batch."""
        self._queue("increment", name, n)

    def get_counters(self) -> dict[str, int]:
        self._flush()
        return execute(self._central.get_counters)

    def set_training_step(self, step: int) -> None:
        """Not waited for; a reader in another process may see it one outbox batch late
        (the controller flushes every outbox before the reads where that matters)."""
        self._queue("set_training_step", step)

    def get_training_step(self) -> int:
        self._flush()
        return execute(self._central.get_training_step)

    def experiment_logger_post(self, backend: str, **kwargs: Unpack[PostOptions]) -> None:
        """Not waited for (two posts a train step); an unknown `backend` raises here."""
        check_backend(backend)
        self._queue("experiment_logger_post", backend, **kwargs)
