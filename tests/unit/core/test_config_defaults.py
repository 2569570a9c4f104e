"""Every default is written once, in the schema: the constructors a config section feeds
read theirs from it. Compared by introspection, so a literal default that drifts from
the schema (the engine's `max_batch_size` once said 128 where the schema said 256) fails
here; typed options reject unknown keys and wrong types naming the key."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import pytest

from nexrl.config.options import (
    ENGINE_KEY,
    InferenceEngineConfig,
    RayGroupConfig,
    RayRanksConfig,
    engine_config,
)
from nexrl.config.schema import RayConfig, RolloutWorkerConfig


def defaults_of(fn: Callable[..., Any]) -> dict[str, Any]:
    """{parameter: default} of `fn`, or of a dataclass's fields (factories called)."""
    if dataclasses.is_dataclass(fn):
        return dataclasses.asdict(fn())  # type: ignore[call-arg]
    params = inspect.signature(fn).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def assert_same(
    section: type, fn: Callable[..., Any], at_least: int, only: tuple[str, ...] = ()
) -> None:
    """`fn`'s defaults of the parameters named like fields of `section` (or `only` those)
    are the schema's."""
    schema, theirs = dataclasses.asdict(section()), defaults_of(fn)
    pairs = {k: (schema[k], v) for k, v in theirs.items() if k in schema and k in (only or schema)}
    assert len(pairs) >= at_least, f"{fn.__qualname__} shares only {sorted(pairs)}"
    drift = {k: v for k, v in pairs.items() if v[0] != v[1]}
    assert not drift, f"{fn.__qualname__}: (schema, constructor) defaults differ: {drift}"


def test_engine_constructors_take_the_schema_defaults():
    from nexrl.inference.engine import Engine
    from nexrl.inference.hf_engine import HFEngine

    assert_same(
        InferenceEngineConfig, Engine.__init__, len(dataclasses.fields(InferenceEngineConfig))
    )
    assert_same(InferenceEngineConfig, HFEngine.__init__, 3)


def test_nexrl_serve_flags_default_to_the_engine_options():
    from nexrl.inference.serve import build_parser

    flags = {a.dest: a.default for a in build_parser()._actions}
    renamed = {"max_batch": "max_batch_size", "emulated_step_latency": "emulated_step_latency_s"}
    schema = dataclasses.asdict(InferenceEngineConfig())
    pairs = {renamed.get(k, k): v for k, v in flags.items() if renamed.get(k, k) in schema}
    assert len(pairs) >= 7, sorted(pairs)
    assert {k: schema[k] for k in pairs} == pairs


def test_ray_constructors_take_the_schema_defaults():
    from nexrl.distributed.dp_train import RayDataParallelTrainClient
    from nexrl.distributed.resource_manager import GroupOptions

    assert_same(RayRanksConfig, RayDataParallelTrainClient.__init__, 3)
    assert_same(RayGroupConfig, GroupOptions, 3, only=("num_cpus", "num_gpus", "resources"))
    # a group's null max_concurrency / max_restarts mean the `ray.*` ones
    assert_same(RayConfig, GroupOptions, 2, only=("max_concurrency", "max_restarts"))


def test_workflows_sample_with_the_rollout_worker_defaults():
    from nexrl.agents.workflows import SingleTurnWorkflow, ToolWorkflow

    want = RolloutWorkerConfig()
    for workflow in (SingleTurnWorkflow(), ToolWorkflow()):
        s = workflow.sampling
        got = (s.max_new_tokens, s.temperature, s.top_p, s.top_k)
        assert got == (want.max_tokens, want.temperature, want.top_p, want.top_k)
    custom = SingleTurnWorkflow(RolloutWorkerConfig(max_tokens=9, temperature=0.5))
    assert (custom.sampling.max_new_tokens, custom.sampling.temperature) == (9, 0.5)


def test_engine_options_are_typed_and_checked():
    cfg = engine_config({"max_batch_size": "64", "threads": 2})
    assert (cfg.max_batch_size, cfg.threads, cfg.dtype) == (64, 2, InferenceEngineConfig.dtype)
    with pytest.raises(ValueError, match=f"{ENGINE_KEY}.max_batch: unknown engine option"):
        engine_config({"max_batch": 64})
    with pytest.raises(ValueError, match=f"{ENGINE_KEY}.gather_max_s='soon'"):
        engine_config({"gather_max_s": "soon"})


def test_a_run_with_typed_engine_options_checks_them_before_building(tmp_path):
    """The client reads the section through the typed options: a wrong type fails before
    any model loads, naming the key; right ones build an engine with them."""
    from nexrl.inference.client import LLMServiceClient, shutdown_local_engines

    with pytest.raises(ValueError, match=f"{ENGINE_KEY}.native_attention"):
        LLMServiceClient({"backend": "builtin", "engine": {"native_attention": "maybe"}})
    shutdown_local_engines()  # an earlier test's engine of the same tag would be reused
    client = LLMServiceClient({"backend": "builtin", "engine": {"max_batch_size": 4, "seed": 3}})
    try:
        assert client._engine.max_batch_size == 4
        out = client.completion("abc", max_tokens=2, temperature=0.0)
        assert len(out["choices"][0]["response_ids"]) == 2
    finally:
        shutdown_local_engines()  # the process-wide engine of the tag, not a later test's


def test_an_engine_is_built_from_the_typed_options(tiny_model_path):
    from nexrl.inference.engine import Engine

    engine = Engine.from_config(
        InferenceEngineConfig(max_batch_size=4, max_model_len=64, prefix_cache_gib=0.0),
        tiny_model_path,
    )
    try:
        assert (engine.max_batch_size, engine.max_model_len, engine.prefix) == (4, 64, None)
    finally:
        engine.shutdown()


def test_ray_maps_are_typed():
    from omegaconf import OmegaConf

    from nexrl.distributed.settings import RaySettings

    raw = {
        "groups": {"train": {"num_cpus": 2, "max_restarts": 1}},
        "train_ranks": {"bundles_per_node": [2], "num_cpus_per_bundle": 0.5},
        "max_concurrency": 8,
    }
    settings = RaySettings.from_config(OmegaConf.create({"ray": raw}))
    assert settings.train_ranks == RayRanksConfig(bundles_per_node=[2], num_cpus_per_bundle=0.5)
    assert settings.inference_replicas == RayRanksConfig()
    train = settings.group_options()["train"]
    assert (train.num_cpus, train.max_restarts, train.max_concurrency) == (2, 1, 8)
    with pytest.raises(ValueError, match=r"ray.train_ranks: unknown key\(s\) \['bundles'\]"):
        RaySettings.from_config(OmegaConf.create({"ray": {"train_ranks": {"bundles": [2]}}}))
