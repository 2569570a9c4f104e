"""`service.train_service.backend: auto` (the default): the trainer runs in a child
process in a local fully-async run with an in-process engine and staleness >= 1, where
it updates while the next batch is generated and shares no interpreter lock with that
rollout, and in this process wherever a child would gain nothing or could not work as
this process does."""

from __future__ import annotations

import sys
import types

import pytest

from nexrl.config import load_config

ASYNC = ["weight.sync_mode=fully-async", "weight.staleness_threshold=1"]


@pytest.mark.parametrize(
    ("overrides", "backend"),
    [
        ([], "builtin"),  # sync: trainer and rollout take turns anyway
        (["weight.sync_mode=batch-async", "weight.staleness_threshold=1"], "builtin"),
        # staleness 0: the next batch waits for the pushed weights, no update overlaps it
        (["weight.sync_mode=fully-async"], "builtin"),
        ([*ASYNC], "process"),
        (["weight.sync_mode=fully-async", "weight.staleness_threshold=2"], "process"),
        ([*ASYNC, "launch_mode=ray"], "builtin"),
        (
            [
                *ASYNC,
                "service.inference_service.backend=remote",
                "service.inference_service.url=http://127.0.0.1:1",
            ],
            "builtin",
        ),
        ([*ASYNC, "algorithm.loss_fn=gspo"], "process"),
        ([*ASYNC, "service.train_service.backend=builtin"], "builtin"),
        (["service.train_service.backend=process"], "process"),
    ],
)
def test_auto_is_made_concrete_when_the_config_loads(tmp_path, overrides, backend):
    cfg = load_config([f"output_dir={tmp_path}", *overrides])
    assert cfg.service.train_service.backend == backend


@pytest.mark.parametrize("registry", ["POLICY_LOSSES", "AGGREGATIONS", "KL_ESTIMATORS"])
def test_a_loss_part_registered_by_user_code_keeps_the_trainer_here(tmp_path, registry):
    """A spawned child has nexrl's own losses, aggregations and KL estimators; one that
    user code registered at run time it may lack."""
    import nexrl.algorithms as algorithms

    table = getattr(algorithms, registry)
    over = [f"output_dir={tmp_path}", *ASYNC]
    table.add("mine", lambda *a, **k: None)  # this module is user code here
    try:
        assert table.registered_outside("nexrl") == ["mine"]
        assert load_config(over).service.train_service.backend == "builtin"
    finally:
        del table._items["mine"]
    assert load_config(over).service.train_service.backend == "process"


@pytest.mark.parametrize(("guarded", "backend"), [(True, "process"), (False, "builtin")])
def test_a_script_without_a_main_guard_keeps_the_trainer_here(
    tmp_path, monkeypatch, guarded, backend
):
    script = tmp_path / "train.py"
    run = f"NexRLController(load_config({ASYNC})).run()\n"
    script.write_text(f'if __name__ == "__main__":\n    {run}' if guarded else run)
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    monkeypatch.setitem(sys.modules, "__main__", main)
    cfg = load_config([f"output_dir={tmp_path}", *ASYNC])
    assert cfg.service.train_service.backend == backend


def test_a_registry_names_what_code_outside_a_package_registered():
    from nexrl.registry import Registry
    from nexrl.rewards import shift_letters

    table = Registry("thing")
    table.add("ours", shift_letters)
    table.add("ours_lazy", "nexrl.rewards:exact_match")
    table.add("theirs_lazy", "mypkg.things:fn")  # judged by its path, not imported
    table.add("theirs", lambda: None)
    assert table.registered_outside("nexrl") == ["theirs", "theirs_lazy"]
    assert table.registered_outside("nex") == table.names()  # a package, not a prefix


def test_a_config_not_loaded_is_made_concrete_by_the_run_setup(tmp_path, tiny_model_path):
    """A config built or edited by hand still holds `auto` until the run resolves it; a
    train client built on its own takes `auto` as `builtin`."""
    from nexrl.run_setup import resolve_run_config
    from nexrl.training.client import TrainServiceClient

    over = [f"output_dir={tmp_path}", f"model_path={tiny_model_path}"]
    cfg = load_config([*over, *ASYNC])
    cfg.service.train_service.backend = "auto"
    assert resolve_run_config(cfg).service.train_service.backend == "process"
    assert TrainServiceClient({"backend": "auto"}, {}, str(tiny_model_path)).backend == "builtin"
