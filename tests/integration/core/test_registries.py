"""Every pluggable kind is a `Registry`: a reward, a tool-call parser, a logger backend
and a train backend that user code registers by name are picked by that name in a real
run (or call), and an unknown name is one error naming the key and the choices."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from nexrl.config import ConfigError
from nexrl.controller import NexRLController
from nexrl.inference.tool_parsers import PARSERS, ParseResult, ToolCall, get_parser
from nexrl.monitoring.loggers import LOGGER_BACKENDS
from nexrl.registry import Registry
from nexrl.rewards import REWARD_FUNCTIONS
from nexrl.training.backends import TRAIN_ENGINES
from nexrl.training.torch_engine import TorchTrainEngine

SEEN: dict[str, list[Any]] = {"rewards": [], "logged": [], "trained": []}


def always_half(prompt: str, completion: str, **row: Any) -> float:
    SEEN["rewards"].append(completion)
    return 0.5


class RecordingBackend:
    def __init__(self, **kwargs: Any) -> None:
        self.experiment = kwargs["experiment_name"]

    def log(self, data: Mapping[str, Any], step: int) -> None:
        SEEN["logged"].append((self.experiment, step, dict(data)))

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class CountingEngine(TorchTrainEngine):
    def train_batch(self, batch: Any, loss_fn: str, loss_kwargs: dict[str, Any]) -> Any:
        SEEN["trained"].append(len(batch))
        return super().train_batch(batch, loss_fn, loss_kwargs)


class EveryReplyCallsEcho:
    def parse(self, text: str) -> ParseResult:
        return "", [ToolCall("echo", {"text": text})], []


@pytest.fixture
def registered() -> Iterator[None]:
    added = [
        (REWARD_FUNCTIONS, "always_half", always_half),
        (LOGGER_BACKENDS, "recording", RecordingBackend),
        (TRAIN_ENGINES, "counting", CountingEngine),
        (PARSERS, "echo_all", EveryReplyCallsEcho),
    ]
    for registry, name, obj in added:
        registry.add(name, obj)
    for seen in SEEN.values():
        seen.clear()
    yield
    for registry, name, _ in added:
        registry._items.pop(name)


@pytest.mark.slow
def test_a_run_picks_a_user_reward_logger_and_train_backend_by_name(registered, small_config):
    cfg = small_config(
        "rollout_worker.reward_fn=always_half",
        "logger.backend=[jsonl,recording]",
        "service.train_service.backend=counting",
        "train_worker.total_train_steps=1",
        "validate.validate_before_train=false",
    )
    NexRLController(cfg).run()
    assert SEEN["rewards"] and SEEN["trained"] == [cfg.trajectory_pool.batch_size]
    steps = [(exp, step) for exp, step, data in SEEN["logged"] if "train/loss" in data]
    assert steps == [(cfg.experiment_name, 1)]
    rewards = [d["reward/mean"] for _, _, d in SEEN["logged"] if "reward/mean" in d]
    assert rewards == [0.5]


def test_a_user_tool_parser_reads_the_replies_of_a_chat(registered, tiny_model_path):
    from nexrl.inference.client import LLMServiceClient, shutdown_local_engines

    client = LLMServiceClient(
        {"backend": "builtin", "model": tiny_model_path, "tool_call_parser": "echo_all"}
    )
    tools = [{"type": "function", "function": {"name": "echo", "parameters": {}}}]
    try:
        out = client.generate([{"role": "user", "content": "hi"}], tools=tools, max_tokens=3)
    finally:
        shutdown_local_engines()  # the process-wide engine of the tag, not a later test's
    (call,) = out["tool_calls"]
    assert call["function"]["name"] == "echo"
    assert json.loads(call["function"]["arguments"]) == {"text": out["choices"][0]["response"]}
    assert isinstance(get_parser("echo_all"), EveryReplyCallsEcho)


@pytest.mark.parametrize(
    ("registry", "override"),
    [
        (REWARD_FUNCTIONS, "rollout_worker.reward_fn"),
        (TRAIN_ENGINES, "service.train_service.backend"),
        (LOGGER_BACKENDS, "logger.backend"),
        (PARSERS, "service.inference_service.tool_call_parser"),
    ],
)
def test_unknown_names_are_one_error_naming_key_and_choices(registry: Registry, override: str):
    choices = ", ".join(registry)
    with pytest.raises(
        ValueError, match=f"{override}: unknown .* 'nope'; valid choices: {choices}"
    ):
        registry.get("nope")


def test_the_config_refuses_an_unknown_train_backend_and_logger():
    from nexrl.config import load_config

    with pytest.raises(ConfigError, match="unknown train backend 'torch'; valid choices: builtin"):
        load_config(["service.train_service.backend=torch"])
    with pytest.raises(ValueError, match="logger.backend: unknown backend 'neptune'"):
        from nexrl.monitoring.loggers import parse_backends

        parse_backends("neptune")
