"""`ray.*` settings and layout checks (no Ray cluster needed)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from nexrl.distributed.ray_system import check_layout
from nexrl.distributed.settings import DEFAULT_COLOCATION, SPLIT_COLOCATION, RaySettings
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


def test_the_default_layout_is_two_actors_and_the_split_one_three():
    assert set(DEFAULT_COLOCATION.values()) == {"rollout", "train"}
    split = RaySettings.from_config(cfg_with({"colocation": SPLIT_COLOCATION}))
    assert set(split.group_options()) == {"data", "rollout", "train"}
    check_layout(cfg_with(), split.colocation)


def test_bad_keys_are_named():
    with pytest.raises(ValueError, match=r"unknown ray key\(s\) \['adress'\]"):
        RaySettings.from_config(cfg_with({"adress": "auto"}))
    with pytest.raises(ValueError, match=r"unknown role\(s\) \['rollout'\]"):
        RaySettings.from_config(cfg_with({"colocation": {"rollout": "x"}}))
    with pytest.raises(ValueError, match=r"ray.groups.train: unknown key\(s\) \['gpus'\]"):
        RaySettings.from_config(cfg_with({"groups": {"train": {"gpus": 1}}})).group_options()


def test_an_in_process_engine_needs_rollout_and_weight_sync_together():
    split = {**DEFAULT_COLOCATION, "weight_sync_controller": "data"}
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


def test_module_threads_follow_the_setting_then_the_environment_then_one(monkeypatch):
    monkeypatch.delenv("NEXRL_ACTOR_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert RaySettings.from_config(cfg_with()).module_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert RaySettings.from_config(cfg_with()).module_threads() == 3
    monkeypatch.setenv("NEXRL_ACTOR_THREADS", "2")
    assert RaySettings.from_config(cfg_with()).module_threads() == 2
    assert RaySettings.from_config(cfg_with({"torch_threads": 1})).module_threads() == 1
    with pytest.raises(ValueError, match="ray.torch_threads must be >= 1"):
        RaySettings.from_config(cfg_with({"torch_threads": 0})).module_threads()
