"""Every config name of seed 000's "Configuration" section (and xtuner's fractional
staleness, seed 003): accepted and mapped, or refused naming nexrl's equivalent."""

from __future__ import annotations

import pytest
import yaml

from nexrl.config import load_config
from nexrl.config.suggest import ConfigError

REFUSED = [
    ("rollout_worker.type=mock", "`simple` generates without a reward"),
    ("algorithm.type=mock", "`grpo` with the embedded tiny model"),
    ("service.train_service.backend=mock", "`builtin` trains the embedded tiny model"),
    ("service.train_service.backend=nextrainer", "`remote` talks to a `nexrl train-service`"),
    ("data.type=mock", "data.path: null uses data.task"),
    ("+train_batch_pool.batch_size=32", "is trajectory_pool.batch_size"),
    ("train_batch_pool.batch_size=32", "is trajectory_pool.batch_size"),
    ("+weight.checkpoint_manager=default", "train_worker.checkpoint_path"),
    ("+service.train_service.identifier=a", "service.train_service.model_tag"),
    ("weight.staleness_threshold=0.2", "weight.over_sample_threshold=0.2"),
    ("trajectory_pool.type=fancy", "one implementation, `default`"),
    ("train_batch_pool.type=fancy", "one implementation, `default`"),
    ("train_worker.type=fancy", "one implementation, `default`"),
    ("weight.type=fancy", "one implementation, `default`"),
    ("validate.eval.type=fancy", "one implementation, `default`"),
]


@pytest.mark.parametrize(("override", "equivalent"), REFUSED)
def test_a_seed_name_nexrl_does_not_use_is_refused_naming_the_equivalent(override, equivalent):
    with pytest.raises(ConfigError, match=equivalent.replace("(", r"\(").replace("`", "`")):
        load_config([override])


def test_the_default_type_is_accepted():
    cfg = load_config(["trajectory_pool.type=default", "weight.type=default"])
    assert cfg.trajectory_pool.type == "default"


def test_single_turn_math_is_single_turn_with_the_math_reward():
    cfg = load_config(["rollout_worker.type=single_turn_math"])
    assert (cfg.rollout_worker.type, cfg.rollout_worker.reward_fn) == ("single_turn", "math")
    cfg = load_config(["rollout_worker.type=single_turn_math", "rollout_worker.reward_fn=gsm8k"])
    assert cfg.rollout_worker.reward_fn == "gsm8k"


def test_a_string_logger_backend_is_a_list():
    assert list(load_config(["logger.backend=jsonl"]).logger.backend) == ["jsonl"]
    for value in ("'jsonl,console'", "jsonl,console", "jsonl, console"):
        cfg = load_config([f"logger.backend={value}"])
        assert list(cfg.logger.backend) == ["jsonl", "console"]


def test_an_integer_staleness_threshold_stays_nexrls():
    cfg = load_config(["weight.sync_mode=fully-async", "weight.staleness_threshold=2"])
    assert cfg.weight.staleness_threshold == 2


def write(tmp_path, body: dict) -> str:
    (tmp_path / "mine.yaml").write_text(
        yaml.safe_dump({"defaults": ["rl_train", "_self_"], **body})
    )
    return str(tmp_path)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"train_batch_pool": {"batch_size": 8}}, "is trajectory_pool.batch_size"),
        ({"weight": {"checkpoint_manager": {"type": "x"}}}, "train_worker.checkpoint_path"),
        ({"weight": {"staleness_threshold": 0.2}}, "weight.over_sample_threshold"),
        ({"logger": {"backend": "wandb"}}, r"backend: \[wandb\]"),
        ({"rollout_worker": {"type": "mock"}}, "nexrl has no mock worker"),
        ({"weight": {"type": "mine"}}, "one implementation"),
    ],
)
def test_seed_names_in_a_yaml_file_are_explained(tmp_path, body, message):
    with pytest.raises(ConfigError, match=message):
        load_config(config_name="mine", config_dir=write(tmp_path, body))


def test_single_turn_math_in_a_yaml_file(tmp_path):
    cfg = load_config(
        config_name="mine",
        config_dir=write(tmp_path, {"rollout_worker": {"type": "single_turn_math"}}),
    )
    assert (cfg.rollout_worker.type, cfg.rollout_worker.reward_fn) == ("single_turn", "math")


class TurnsWorkflow:
    """A seed-004 style workflow: reads its config by attribute."""

    def __init__(self, config):
        self.config = config

    async def arun_episode(self, engine, data):
        return None


def test_the_seeds_rollout_workflow_keys_reach_an_agent_workflow_typed():
    from nexrl.builders import section
    from nexrl.rollout.agent import build_workflow

    cfg = load_config(
        [
            "rollout_worker.type=agent",
            f"rollout_worker.workflow={__name__}:TurnsWorkflow",
            "rollout.workflow.num_turns=2",
            "rollout.workflow.tool=calc",
        ]
    )
    workflow = build_workflow(section(cfg.rollout_worker), None)
    assert workflow.config.num_turns == 2 and workflow.config.tool == "calc"
