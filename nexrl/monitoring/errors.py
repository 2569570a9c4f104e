"""Error reporting: severities, a bounded error log, health status and stop policies.

Modules never swallow errors into default values (a failed reward is not a 0).
They report them here with a severity; the controller reads the health status
every `runtime_monitor.exception_handling.check_interval` seconds and asks
`should_stop(health, policy)` whether the run ends. Keeping the policy a pure
function of the status dict makes it testable without a running controller.

"Recent" means within `recent_window_s` seconds (default 300): the controller
polls far more often than that, so no error escapes the policy, while a long
run that recovered from one warning an hour ago reads as healthy again.

A failed task (an exception in a rollout step, e.g. a reward that raised or timed
out) is an ERROR too, but the task owner already re-queues or counts it, so one
failing sample must not end a run (verl and AReaL carry on past a bad sample). The
policies therefore count errors since the last train step (`note_progress`): a run
that only fails reaches `max_consecutive_errors` within seconds and stops, whatever
the policy but `continue`; a run that trains between its failures goes on.
"""

from __future__ import annotations

import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, TypedDict


class ErrorSeverity(Enum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


@dataclass
class ErrorInfo:
    """One reported error."""

    error_id: str
    timestamp: float
    module_name: str
    work_context: str
    severity: ErrorSeverity
    message: str
    details: dict[str, object] = field(default_factory=dict)
    exception_type: str | None = None
    exception_traceback: str | None = None


class HealthStatus(TypedDict):
    """`ErrorReporter.get_health_status`: the recent errors, aggregated."""

    status: Literal["healthy", "warning", "error", "critical"]
    message: str
    recent_error_count: int
    critical_level_count: int
    error_level_count: int
    warning_level_count: int
    info_level_count: int
    total_error_count: int
    last_error: str | None
    task_error_count: int
    consecutive_error_count: int


class ErrorReporter:
    """Thread-safe, bounded store of `ErrorInfo` with an aggregated health status."""

    def __init__(self, max_errors: int = 1000, recent_window_s: float = 300.0) -> None:
        self._errors: deque[ErrorInfo] = deque(maxlen=max_errors)
        self._recent_window_s = recent_window_s
        self._lock = threading.Lock()
        self._total_by_severity = {s: 0 for s in ErrorSeverity}
        self._since_progress = 0  # ERROR / CRITICAL reports since the last train step

    def report_exception(
        self,
        module_name: str,
        work_context: str,
        exception: BaseException,
        severity: ErrorSeverity = ErrorSeverity.ERROR,
        details: dict[str, object] | None = None,
    ) -> str:
        """Record an exception (type, message and traceback); returns its error id."""
        tb = "".join(
            traceback.format_exception(type(exception), exception, exception.__traceback__)
        )
        return self._add(
            module_name,
            work_context,
            f"{type(exception).__name__}: {exception}",
            severity,
            details,
            type(exception).__name__,
            tb,
        )

    def report_error(
        self,
        module_name: str,
        work_context: str,
        message: str,
        severity: ErrorSeverity = ErrorSeverity.ERROR,
        details: dict[str, object] | None = None,
    ) -> str:
        """Record an error that has no exception object; returns its error id."""
        return self._add(module_name, work_context, message, severity, details, None, None)

    def _add(
        self,
        module_name: str,
        work_context: str,
        message: str,
        severity: ErrorSeverity,
        details: dict[str, object] | None,
        exc_type: str | None,
        tb: str | None,
    ) -> str:
        severity = ErrorSeverity(severity)
        info = ErrorInfo(
            error_id=uuid.uuid4().hex[:12],
            timestamp=time.time(),
            module_name=module_name,
            work_context=work_context,
            severity=severity,
            message=message,
            details=dict(details or {}),
            exception_type=exc_type,
            exception_traceback=tb,
        )
        with self._lock:
            self._errors.append(info)
            self._total_by_severity[severity] += 1
            if severity in (ErrorSeverity.ERROR, ErrorSeverity.CRITICAL):
                self._since_progress += 1
        return info.error_id

    def note_progress(self) -> None:
        """A train step finished: the errors before it no longer count as consecutive."""
        with self._lock:
            self._since_progress = 0

    def get_errors(self, severity: ErrorSeverity | None = None) -> list[ErrorInfo]:
        """All retained errors (oldest first), optionally of one severity."""
        with self._lock:
            return [e for e in self._errors if severity is None or e.severity == severity]

    def clear(self) -> None:
        with self._lock:
            self._errors.clear()
            self._since_progress = 0

    def get_health_status(self) -> HealthStatus:
        """Aggregate of the recent errors.

        Keys: `status` ("healthy" | "warning" | "error" | "critical"), `message`,
        `recent_error_count`, `critical_level_count`, `error_level_count`,
        `warning_level_count`, `info_level_count`, `total_error_count`, `last_error`,
        `task_error_count` (recent ERRORs that are failed tasks, see `TASK_CONTEXTS`),
        `consecutive_error_count` (ERROR / CRITICAL reports since the last train step).
        """
        cutoff = time.time() - self._recent_window_s
        with self._lock:
            recent = [e for e in self._errors if e.timestamp >= cutoff]
            total = sum(self._total_by_severity.values())
            consecutive = self._since_progress
        counts = {s: sum(e.severity == s for e in recent) for s in ErrorSeverity}
        status: Literal["healthy", "warning", "error", "critical"]
        if counts[ErrorSeverity.CRITICAL]:
            status = "critical"
        elif counts[ErrorSeverity.ERROR]:
            status = "error"
        elif counts[ErrorSeverity.WARNING]:
            status = "warning"
        else:
            status = "healthy"
        last = next((e for e in reversed(recent) if e.severity != ErrorSeverity.INFO), None)
        message = (
            "no recent errors"
            if last is None
            else f"{len(recent)} recent; last [{last.severity.value}] "
            f"{last.module_name}/{last.work_context}: {last.message}"
        )
        return {
            "status": status,
            "message": message,
            "recent_error_count": len(recent),
            "critical_level_count": counts[ErrorSeverity.CRITICAL],
            "error_level_count": counts[ErrorSeverity.ERROR],
            "warning_level_count": counts[ErrorSeverity.WARNING],
            "info_level_count": counts[ErrorSeverity.INFO],
            "total_error_count": total,
            "last_error": None if last is None else last.message,
            "task_error_count": sum(
                e.severity == ErrorSeverity.ERROR and e.work_context in TASK_CONTEXTS
                for e in recent
            ),
            "consecutive_error_count": consecutive,
        }


STOP_POLICIES = ("stop_on_error", "stop_on_critical", "continue")
TASK_CONTEXTS = frozenset({"rollout step"})
"""Work contexts whose errors are failed tasks (re-queued or counted by the task owner)."""
MAX_CONSECUTIVE_ERRORS = 16
"""Default of `runtime_monitor.exception_handling.max_consecutive_errors`."""


def should_stop(
    health: HealthStatus, policy: str, max_consecutive_errors: int = MAX_CONSECUTIVE_ERRORS
) -> bool:
    """Whether the run must stop given a `get_health_status()` dict and a policy.

    - "stop_on_error": stop on a recent CRITICAL, on a recent ERROR of a module (not a
      failed task), or once `max_consecutive_errors` errors came with no train step
      between them. A failed task alone is counted, not fatal.
    - "stop_on_critical": stop on a recent CRITICAL, or once `max_consecutive_errors`
      errors came with no train step between them (a run that only fails).
    - "continue": never stop because of reported errors.
    """
    if policy not in STOP_POLICIES:
        raise ValueError(
            f"runtime_monitor.exception_handling.policy: unknown policy {policy!r}; "
            f"valid choices: {', '.join(STOP_POLICIES)}"
        )
    if policy == "continue":
        return False
    critical = health.get("critical_level_count", 0) > 0 or health.get("status") == "critical"
    failing = health.get("consecutive_error_count", 0) >= max(1, max_consecutive_errors)
    if critical or failing:
        return True
    if policy == "stop_on_critical":
        return False
    module_errors = health.get("error_level_count", 0) - health.get("task_error_count", 0)
    return module_errors > 0
