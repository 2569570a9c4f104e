"""The `nexrl` command line: user modules from the current folder, "did you mean" for
unknown keys (never a silent `+key`), `--cfg`, user recipes, one option style."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from nexrl.cli import COMMANDS, check_engine_overrides, main, put_cwd_on_path


def _train(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["train", "--log-level", "WARNING", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cfg_prints_the_composed_config_with_overrides(capsys) -> None:
    rc, out, _ = _train(capsys, "--cfg", "train_worker.total_train_steps=7", "seed=5")
    assert rc == 0
    cfg = yaml.safe_load(out)
    assert cfg["train_worker"]["total_train_steps"] == 7 and cfg["seed"] == 5
    assert "rollout_worker" in cfg and "logger" in cfg
    rc, out2, _ = _train(capsys, "--print-config", "--model-path", "/m", "seed=5")
    assert rc == 0 and yaml.safe_load(out2)["model_path"] == "/m"
    rc, out3, _ = _train(capsys, "--cfg", "job", "seed=6")  # Hydra's spelling
    assert rc == 0 and yaml.safe_load(out3)["seed"] == 6


@pytest.mark.parametrize(
    "override, meant",
    [
        ("train_worker.totl_train_steps=3", "train_worker.total_train_steps"),
        ("+train_worker.totl_train_steps=3", "train_worker.total_train_steps"),  # no silent +
        ("rollout_worker.groupsize=4", "rollout_worker.group_size"),
        ("+sed=1", "seed"),
        ("wieght.sync_mode=sync", "weight.sync_mode"),
    ],
)
def test_unknown_key_says_did_you_mean_and_fails(capsys, override, meant) -> None:
    rc, out, err = _train(capsys, "--cfg", override)
    assert rc == 2 and out == ""
    assert "unknown config key" in err and f"did you mean '{meant}'" in err, err
    assert "To append to your config use" not in err


def test_free_form_dicts_take_plus_keys_and_say_so_without_it(capsys) -> None:
    rc, out, _ = _train(capsys, "--cfg", "+algorithm.loss_kwargs.kl_coef=0.1")
    assert rc == 0 and yaml.safe_load(out)["algorithm"]["loss_kwargs"]["kl_coef"] == 0.1
    rc, _, err = _train(capsys, "--cfg", "algorithm.loss_kwargs.kl_coef=0.1")
    assert rc == 2 and "'algorithm.loss_kwargs' is a free-form dict" in err
    assert "+algorithm.loss_kwargs.kl_coef=VALUE" in err


def test_bad_value_keeps_the_type_message(capsys) -> None:
    rc, _, err = _train(capsys, "--cfg", "rollout_worker.group_size=abc")
    assert rc == 2 and "could not be converted to Integer" in err
    assert "unknown config key" not in err


def _recipe(folder: Path, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "my_recipe.yaml"
    path.write_text("defaults: [rl_train, _self_]\n" + textwrap.dedent(body))
    return path


def test_user_recipe_by_config_dir_and_name_or_by_path(tmp_path, capsys) -> None:
    path = _recipe(
        tmp_path / "recipes",
        """
        experiment_name: my_recipe
        rollout_worker:
          group_size: 4
        trajectory_pool:
          batch_size: 32
        """,
    )
    args = ["--config-dir", str(path.parent), "--config-name", "my_recipe", "--cfg"]
    rc, out, _ = _train(capsys, *args, "seed=9")
    cfg = yaml.safe_load(out)
    assert rc == 0 and cfg["experiment_name"] == "my_recipe" and cfg["seed"] == 9
    assert cfg["rollout_worker"]["group_size"] == 4
    assert cfg["weight"]["sync_mode"] == "sync"  # inherited from the packaged rl_train
    rc, out, _ = _train(capsys, "--config-name", str(path), "--cfg")
    assert rc == 0 and yaml.safe_load(out)["experiment_name"] == "my_recipe"


def test_unknown_key_in_a_recipe_file_says_did_you_mean(tmp_path, capsys) -> None:
    path = _recipe(tmp_path, "rollout_worker:\n  temprature: 0.7\n")
    rc, _, err = _train(capsys, "--config-name", str(path), "--cfg")
    assert rc == 2 and "did you mean 'rollout_worker.temperature'" in err, err


def test_cwd_goes_on_the_import_path_and_pythonpath(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_rewards_h17.py").write_text("def score(p, c, **row):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    put_cwd_on_path()
    assert importlib.import_module("my_rewards_h17").score("a", "b") == 1.0
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/elsewhere"]
    put_cwd_on_path()  # idempotent
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/elsewhere"]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_has_the_same_help_shape(command, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert out.startswith(f"usage: nexrl {command}")
    assert "--log-level" in out
    if command != "plot":
        assert "--model-path" in out


def test_top_level_usage_lists_every_command(capsys) -> None:
    assert main(["--help"]) == 0
    err = capsys.readouterr().err
    assert all(f"  {name} " in err for name in COMMANDS)
    assert main(["tran"]) == 2 and "unknown command 'tran'" in capsys.readouterr().err


def test_engine_overrides_of_sft_and_train_service_say_did_you_mean(capsys) -> None:
    assert check_engine_overrides("nexrl sft", ["lr=1e-3", "--steps", "3"]) is None
    error = check_engine_overrides("nexrl sft", ["lrr=1e-3"])
    assert error is not None and "unknown engine config key 'lrr'; did you mean 'lr'" in error
    assert main(["train-service", "--log-level", "ERROR", "weight_decey=0.1"]) == 2
    assert "did you mean 'weight_decay'" in capsys.readouterr().err


@pytest.mark.slow
def test_quickstart_reward_module_in_the_current_folder_local_mode(tmp_path) -> None:
    """The console script, run from a folder holding my_rewards.py, trains with it."""
    (tmp_path / "my_rewards.py").write_text(
        "import pathlib\n"
        "def score(prompt, completion, **row):\n"
        "    pathlib.Path('called').write_text('yes')\n"
        "    return float(len(completion) > 0)\n"
    )
    script = Path(sys.executable).parent / "nexrl"
    env = {**os.environ, "NEXRL_HOME": str(tmp_path / "home")}
    env.pop("PYTHONPATH", None)
    overrides = [
        "rollout_worker.reward_fn=my_rewards:score",
        "train_worker.total_train_steps=1",
        "rollout_worker.group_size=4",
        "trajectory_pool.batch_size=8",
        "validate.validate_before_train=false",
        "validate.data.max_items=4",
        "logger.backend=[jsonl]",
        "output_dir=outputs",
    ]
    proc = subprocess.run(
        [str(script), "train", *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "called").read_text() == "yes"
