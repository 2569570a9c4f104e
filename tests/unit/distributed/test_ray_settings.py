"""`ray.*` settings and layout checks (no Ray cluster needed)."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from nexrl.distributed.ray_system import check_layout
from nexrl.distributed.settings import (
    DEFAULT_COLOCATION,
    ROLLOUT_TRAIN_COLOCATION,
    SPLIT_COLOCATION,
    RaySettings,
)
from nexrl.execute import default_timeout, set_default_timeout
from nexrl.monitoring import ActivityTracker


def cfg_with(ray: dict | None = None, backend: str = "builtin"):
    base = {"service": {"inference_service": {"backend": backend, "engine": {}}}}
    return OmegaConf.create({**base, **({"ray": ray} if ray is not None else {})})


def test_defaults_and_overrides_merge_over_the_default_layout():
    assert RaySettings.from_config(cfg_with()).colocation == DEFAULT_COLOCATION
    s = RaySettings.from_config(
        cfg_with(
            {
                "layout": "rollout_train",
                "max_restarts": 2,
                "colocation": {"validator": None},
                "groups": {"train": {"num_gpus": 1}},
            }
        )
    )
    assert s.colocation["validator"] is None and s.colocation["data_loader"] == "rollout"
    opts = s.group_options()
    assert (opts["train"].num_gpus, opts["train"].max_restarts, opts["rollout"].num_gpus) == (
        1,
        2,
        0,
    )


def test_a_ray_section_that_is_no_mapping_is_a_clear_error():
    with pytest.raises(ValueError, match="ray must be a mapping of ray.\\* keys, got \\[1, 2\\]"):
        RaySettings.from_config(cfg_with([1, 2]))


def test_layouts_one_actor_by_default_then_two_and_three():
    default = RaySettings.from_config(cfg_with())
    assert set(default.colocation.values()) == {"main"} and default.module_actors() == 1
    two = RaySettings.from_config(cfg_with({"layout": "rollout_train"}))
    assert set(two.group_options()) == {"rollout", "train"} and two.module_actors() == 2
    split = RaySettings.from_config(cfg_with({"layout": "split"}))
    assert split.colocation == SPLIT_COLOCATION and split.module_actors() == 3
    own = RaySettings.from_config(cfg_with({"colocation": {"validator": None}}))
    assert own.module_actors() == 2  # `main` and the validator's own actor
    for layout in (default, two, split):
        check_layout(cfg_with(), layout.colocation)
    with pytest.raises(ValueError, match=r"ray.layout='two'; choose one of"):
        RaySettings.from_config(cfg_with({"layout": "two"}))


def test_module_threads_split_the_drivers_threads_over_the_module_actors(monkeypatch):
    import torch

    monkeypatch.delenv("NEXRL_ACTOR_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert RaySettings.from_config(cfg_with()).module_threads() == 4
    assert RaySettings.from_config(cfg_with({"layout": "rollout_train"})).module_threads() == 2
    assert RaySettings.from_config(cfg_with({"layout": "split"})).module_threads() == 1
    assert RaySettings.from_config(cfg_with({"torch_threads": 3})).module_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert RaySettings.from_config(cfg_with()).module_threads() == 3
    monkeypatch.setenv("NEXRL_ACTOR_THREADS", "2")
    assert RaySettings.from_config(cfg_with()).module_threads() == 2
    with pytest.raises(ValueError, match="ray.torch_threads must be >= 1"):
        RaySettings.from_config(cfg_with({"torch_threads": 0})).module_threads()


def test_bad_keys_are_named():
    with pytest.raises(ValueError, match=r"unknown ray key\(s\) \['adress'\]"):
        RaySettings.from_config(cfg_with({"adress": "auto"}))
    with pytest.raises(ValueError, match=r"unknown role\(s\) \['rollout'\]"):
        RaySettings.from_config(cfg_with({"colocation": {"rollout": "x"}}))
    with pytest.raises(ValueError, match=r"ray.groups.train: unknown key\(s\) \['gpus'\]"):
        RaySettings.from_config(cfg_with({"groups": {"train": {"gpus": 1}}})).group_options()


def test_an_in_process_engine_needs_rollout_and_weight_sync_together():
    split = {**ROLLOUT_TRAIN_COLOCATION, "weight_sync_controller": "data"}
    with pytest.raises(ValueError, match="must name the same group"):
        check_layout(cfg_with(), split)
    check_layout(cfg_with(backend="remote"), split)  # a server: any layout
    with_replicas = cfg_with()
    with_replicas.service.inference_service.engine.replica_actors = ["r0"]
    check_layout(with_replicas, split)


def test_execute_timeout_is_settable_and_validated():
    old = default_timeout()
    try:
        set_default_timeout(7)
        assert default_timeout() == 7.0
        with pytest.raises(ValueError, match="execute_timeout_s must be > 0"):
            set_default_timeout(0)
    finally:
        set_default_timeout(old)


def test_forget_module_drops_only_that_modules_work():
    tracker = ActivityTracker()
    tracker.start("rollout_worker_0", "rollout")
    kept = tracker.start("train_worker_0", "train step")
    assert tracker.forget_module("rollout_worker_0") == 1
    assert "rollout_worker_0" not in tracker.get_running_status_summary()
    tracker.end(kept)
    assert tracker.is_quiescent()


def test_a_local_ray_starts_quiet_unless_the_user_set_the_variables(monkeypatch):
    """No idle pre-started workers, no metrics collection, actors at the driver's
    priority: set before `ray.init` (the raylet reads them), a user's own value kept."""
    from nexrl.distributed import settings as settings_module

    calls: list[dict] = []
    monkeypatch.setattr(settings_module.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(settings_module.ray, "init", lambda **kw: calls.append(kw))
    for name in settings_module.QUIET_RAY_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_enable_metrics_collection", "1")
    assert settings_module.init_ray(RaySettings.from_config(cfg_with()))
    assert len(calls) == 1 and "address" not in calls[0]
    env = {name: os.environ.get(name) for name in settings_module.QUIET_RAY_ENV}
    assert env == {
        "RAY_worker_niceness": "0",
        "RAY_prestart_worker_first_driver": "0",
        "RAY_enable_metrics_collection": "1",  # the user's, kept
    }
