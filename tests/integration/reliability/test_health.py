"""The fault vocabulary: OOM recognition, exit descriptions, the restart budget."""

from __future__ import annotations

import errno
import signal
import time

from nexrl.inference.health import OOM_EXIT_CODE, RestartBudget, describe_exit, is_oom


def test_oom_is_recognised_in_the_forms_torch_and_python_raise_it():
    assert is_oom(MemoryError())
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried 1 GB"))
    assert is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError(f"Cannot allocate memory (os error {errno.ENOMEM})"))
    assert not is_oom(RuntimeError("could not create a primitive"))
    assert not is_oom(ValueError("out of memory"))  # a validation error is not an OOM


def test_exit_descriptions_name_the_cause():
    assert describe_exit(-signal.SIGKILL).startswith("killed by SIGKILL")
    assert "OOM killer" in describe_exit(-signal.SIGKILL)
    assert describe_exit(OOM_EXIT_CODE) == "stopped after running out of memory"
    assert describe_exit(1) == "exited with status 1"


def test_restart_budget_counts_within_its_window():
    budget = RestartBudget(max_restarts=2, window_s=3600)
    assert budget.take() and budget.take()
    assert not budget.take()
    expired = RestartBudget(max_restarts=1, window_s=0.01)
    assert expired.take()
    time.sleep(0.05)
    assert expired.take()  # the earlier restart has left the window
