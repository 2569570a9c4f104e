from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nexrl.config import ConfigError, load_config
from nexrl.config.reference import render
from tests.fresh import run_fresh

ROOT = Path(__file__).resolve().parents[3]


def test_default_config_loads_with_seed_sections():
    cfg = load_config()
    for section in (
        "data",
        "rollout_worker",
        "trajectory_pool",
        "algorithm",
        "train_batch_pool",
        "train_worker",
        "weight",
        "service",
        "validate",
        "resume",
        "logger",
        "runtime_monitor",
        "launch_mode",
    ):
        assert section in cfg
    assert cfg.trajectory_pool.group_size == cfg.rollout_worker.group_size


def test_override_changes_value():
    cfg = load_config(["train_worker.total_train_steps=20"])
    assert cfg.train_worker.total_train_steps == 20


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("data.bogus=1", "data.bogus"),
        ("train_worker.total_train_steps=abc", "train_worker.total_train_steps"),
        ("weight.sync_mode=eventually", "weight.sync_mode"),
        ("runtime_monitor.exception_handling.policy=pray", "policy"),
        ("launch_mode=cloud", "launch_mode"),
        ("rollout_worker.num_workers=0", "rollout_worker.num_workers=0 must be >= 1"),
        ("train_worker.num_workers=0", "train_worker.num_workers=0 must be >= 1"),
        ("train_worker.num_workers=2", "train_worker.num_workers=2: a run has one train worker"),
        ("validate.concurrency=0", "validate.concurrency=0 must be >= 1"),
    ],
)
def test_bad_override_names_the_key(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config([override])


def test_batch_size_must_hold_whole_groups():
    with pytest.raises(ConfigError, match="multiple of"):
        load_config(["trajectory_pool.batch_size=10"])


def test_fewer_rollout_workers_than_groups_per_batch_warn(caplog):
    with caplog.at_level("WARNING", logger="nexrl.config.loader"):
        load_config(["trajectory_pool.batch_size=64", "rollout_worker.group_size=8"])
        assert not caplog.records  # 16 workers for 8 groups
        load_config(["trajectory_pool.batch_size=64", "rollout_worker.group_size=8",
                     "rollout_worker.num_workers=3"])  # fmt: skip
    (record,) = caplog.records
    assert "rollout_worker.num_workers=3 is below the 8 groups" in record.getMessage()
    assert "in 3 rounds" in record.getMessage()


@pytest.mark.parametrize(("concurrency", "workers", "each"), [(64, 16, 4), (40, 16, 3), (8, 16, 1)])
def test_validation_concurrency_is_spread_over_the_rollout_workers(concurrency, workers, each):
    from nexrl.rollout.base import RolloutContext

    cfg = load_config([f"validate.concurrency={concurrency}",
                       f"rollout_worker.num_workers={workers}"])  # fmt: skip
    assert RolloutContext.from_config(cfg).validate_tasks_per_worker == each


def test_unknown_key_in_user_yaml_is_named(tmp_path):
    (tmp_path / "mine.yaml").write_text(
        "defaults:\n  - rl_train\n  - _self_\ntrain_worker:\n  total_steps: 3\n"
    )
    with pytest.raises(ConfigError, match="total_steps"):
        load_config(config_name="mine", config_dir=tmp_path)


def test_user_yaml_inherits_the_default(tmp_path):
    (tmp_path / "mine.yaml").write_text(
        "defaults:\n  - rl_train\n  - _self_\nexperiment_name: mine\n"
    )
    cfg = load_config(["seed=3"], config_name="mine", config_dir=tmp_path)
    assert cfg.experiment_name == "mine" and cfg.seed == 3 and cfg.data.seed == 3


@pytest.mark.parametrize("path", sorted((ROOT / "nexrl" / "config").rglob("*.yaml")))
def test_every_shipped_config_loads(path, caplog):
    with caplog.at_level("WARNING", logger="nexrl.config.loader"):
        cfg = load_config(config_name=path.stem, config_dir=path.parent)
    OmegaConf.to_container(cfg, resolve=True)
    assert not caplog.records  # e.g. a recipe whose batch generates in rounds


def test_configuration_reference_is_current():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc == render(), "run: python -m nexrl.config.reference > docs/configuration.md"


def test_loading_and_checking_a_config_imports_no_torch():
    """A bad config fails before any heavy import."""
    code = (
        "import sys\n"
        "from nexrl.config import ConfigError, load_config\n"
        "load_config(['weight.transport=memory'])\n"
        "try:\n"
        "    load_config(['service.train_service.backend=remote', 'weight.transport=memory'])\n"
        "except ConfigError as exc:\n"
        "    print('refused:', exc)\n"
        "print('torch' in sys.modules)\n"
    )
    refused, torch_loaded = run_fresh(code).stdout.strip().splitlines()
    assert "weight.transport=memory needs the trainer built in" in refused
    assert torch_loaded == "False"
