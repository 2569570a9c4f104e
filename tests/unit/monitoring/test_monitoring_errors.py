"""ErrorReporter health status and the runtime_monitor stop policies."""

from __future__ import annotations

import pytest

from nexrl.monitoring import ErrorReporter, ErrorSeverity, should_stop


def raise_and_catch() -> ValueError:
    try:
        raise ValueError("reward exploded")
    except ValueError as exc:
        return exc


def test_health_status_escalates_with_severity() -> None:
    rep = ErrorReporter()
    assert rep.get_health_status()["status"] == "healthy"
    rep.report_error("m", "w", "fyi", ErrorSeverity.INFO)
    assert rep.get_health_status()["status"] == "healthy"
    rep.report_error("m", "w", "careful", ErrorSeverity.WARNING)
    assert rep.get_health_status()["status"] == "warning"
    eid = rep.report_exception("rollout_0", "reward", raise_and_catch())
    health = rep.get_health_status()
    assert health["status"] == "error" and health["error_level_count"] == 1
    assert health["recent_error_count"] == 3 and "reward exploded" in health["message"]
    info = rep.get_errors(ErrorSeverity.ERROR)[0]
    assert info.error_id == eid and info.exception_type == "ValueError"
    assert "raise ValueError" in info.exception_traceback
    rep.report_error("m", "w", "dead", ErrorSeverity.CRITICAL, details={"k": 1})
    assert rep.get_health_status()["status"] == "critical"


def test_max_errors_bounds_memory_and_window_forgets() -> None:
    rep = ErrorReporter(max_errors=3)
    for i in range(5):
        rep.report_error("m", "w", f"e{i}")
    assert [e.message for e in rep.get_errors()] == ["e2", "e3", "e4"]
    assert rep.get_health_status()["total_error_count"] == 5
    old = ErrorReporter(recent_window_s=-1.0)  # nothing counts as recent
    old.report_error("m", "w", "long ago", ErrorSeverity.CRITICAL)
    assert old.get_health_status()["status"] == "healthy"


@pytest.mark.parametrize(
    ("severity", "stop_on_error", "stop_on_critical"),
    [
        (None, False, False),
        (ErrorSeverity.WARNING, False, False),
        (ErrorSeverity.ERROR, True, False),
        (ErrorSeverity.CRITICAL, True, True),
    ],
)
def test_policies(severity, stop_on_error: bool, stop_on_critical: bool) -> None:
    rep = ErrorReporter()
    if severity is not None:
        rep.report_error("m", "w", "x", severity)
    health = rep.get_health_status()
    assert should_stop(health, "stop_on_error") is stop_on_error
    assert should_stop(health, "stop_on_critical") is stop_on_critical
    assert should_stop(health, "continue") is False


def test_unknown_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="stop_on_error, stop_on_critical, continue"):
        should_stop({"status": "healthy"}, "stop_sometimes")


def test_failed_tasks_stop_only_past_the_consecutive_limit() -> None:
    """A failed task is counted, not fatal; a run that only fails stops under either
    policy; a train step between failures resets the count."""
    rep = ErrorReporter()
    rep.report_error("rollout_worker_0", "rollout step", "reward timeout")
    health = rep.get_health_status()
    assert health["task_error_count"] == 1
    assert should_stop(health, "stop_on_error", max_consecutive_errors=3) is False
    for _ in range(2):
        rep.report_error("rollout_worker_0", "rollout step", "reward timeout")
    health = rep.get_health_status()
    assert health["consecutive_error_count"] == 3
    assert should_stop(health, "stop_on_error", max_consecutive_errors=3) is True
    assert should_stop(health, "stop_on_critical", max_consecutive_errors=3) is True
    assert should_stop(health, "continue", max_consecutive_errors=3) is False
    rep.note_progress()  # a train step
    assert should_stop(rep.get_health_status(), "stop_on_critical", 3) is False
    rep.report_error("train_worker_0", "train step", "NaN loss")  # a module's error
    assert should_stop(rep.get_health_status(), "stop_on_error", 3) is True
    assert should_stop(rep.get_health_status(), "stop_on_critical", 3) is False
