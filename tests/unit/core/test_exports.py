"""Every public name of seed 000 (NexRL guide) and seed 004 (AReaL-lite) is importable
from `nexrl`, listed by `dir(nexrl)`, and resolves to what the seed means by it."""

from __future__ import annotations

import subprocess
import sys

import pytest

import nexrl

# The class and function headings of seed 000's API reference and code examples.
SEED_000 = [
    "NexRLController", "NexRLModule", "NexRLRole", "Batch", "Trajectory", "ModelTag",
    "BaseDataLoader", "LLMServiceClient", "BaseRolloutWorker", "SimpleRolloutWorker",
    "AgentRolloutWorker", "TrajectoryPool", "TrajectoryPoolInstance", "SimpleTrajectoryStore",
    "GroupedTrajectoryStore", "HierarchicalTrajectoryStore", "BaseAlgorithmProcessor",
    "TrainBatchPool", "Validator", "TrainWorker", "TrainServiceClient", "WeightSyncController",
    "ActivityTracker", "ActivityTrackerProxy", "ErrorReporter", "ErrorSeverity", "ErrorInfo",
    "RayResourceManager", "RayActorWrapper", "execute", "execute_async",
]  # fmt: skip
# Seed 004's engine, workflow and tooling API.
SEED_004 = [
    "InferenceEngine", "TrainEngine", "RolloutWorkflow", "WorkflowExecutor", "WeightUpdateMeta",
    "SaveLoadMeta", "FinetuneSpec", "LLMRequest", "LLMResponse", "ToolingEnv", "LocalToolingEnv",
    "MCPToolingEnv",
]  # fmt: skip
AREAL = "nexrl.areal"  # the AReaL-lite API package; names only it defines wait for it


def _from_areal(name: str) -> bool:
    entry = nexrl._EXPORTS[name]
    return AREAL in ((entry,) if isinstance(entry, str) else entry)


def test_the_table_and_dir_hold_every_seed_name():
    names = SEED_000 + SEED_004
    assert [n for n in names if n not in nexrl._EXPORTS] == []
    assert [n for n in names if n not in dir(nexrl)] == []
    assert set(nexrl.__all__) == set(nexrl._EXPORTS)


@pytest.mark.parametrize("name", sorted(nexrl._EXPORTS))
def test_each_name_resolves_or_names_the_missing_module(name):
    try:
        value = getattr(nexrl, name)
    except ImportError as exc:  # only a name of the AReaL-lite package, while it is absent
        assert _from_areal(name), exc
        return
    assert getattr(value, "__name__", name) == name or name in ("Trajectory", "ModelTag")


def test_execute_is_the_function_even_after_its_module_was_imported():
    code = (
        "import nexrl.execute, inspect\n"
        "from nexrl import execute, execute_async\n"
        "print(inspect.isfunction(execute), inspect.isfunction(execute_async))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        nexrl.Nope  # noqa: B018


def test_a_name_whose_module_is_absent_is_one_import_error(monkeypatch):
    monkeypatch.setitem(nexrl._EXPORTS, "Nowhere", "nexrl.no_such_module")
    monkeypatch.delitem(nexrl.__dict__, "Nowhere", raising=False)
    with pytest.raises(ImportError, match=r"^nexrl.Nowhere is defined in nexrl.no_such_module, "):
        nexrl.Nowhere  # noqa: B018
