"""Monitoring: activity tracking, error reporting and experiment logging."""

from nexrl.monitoring.activity import ActivityTracker, ActivityTrackerProxy
from nexrl.monitoring.errors import (
    STOP_POLICIES,
    ErrorInfo,
    ErrorReporter,
    ErrorSeverity,
    should_stop,
)
from nexrl.monitoring.loggers import LOGGER_BACKENDS, ExperimentLogger

__all__ = [
    "LOGGER_BACKENDS",
    "STOP_POLICIES",
    "ActivityTracker",
    "ActivityTrackerProxy",
    "ErrorInfo",
    "ErrorReporter",
    "ErrorSeverity",
    "ExperimentLogger",
    "should_stop",
]
