"""Packaging: a local run needs neither Ray nor the server stack; extras name features;
every base dependency is used; the declared transformers floor has the API we call."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
OPTIONAL = {"ray", "fastapi", "uvicorn", "prometheus_client", "starlette", "torchdata"}
IMPORT_NAMES = {"hydra-core": "hydra", "prometheus-client": "prometheus_client"}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower()


def test_base_dependencies_leave_out_ray_and_the_server_stack() -> None:
    base = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    assert not base & {"ray", "fastapi", "uvicorn", "prometheus-client", "torchdata", "wandb"}
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {_name(r) for r in extras["ray"]} == {"ray"}
    assert {_name(r) for r in extras["serve"]} == {"fastapi", "uvicorn", "prometheus-client"}
    for feature in ("wandb", "tensorboard", "mlflow", "plot"):
        assert extras[feature], feature
    everything = extras["all"][0]
    for feature in ("ray", "serve", "wandb", "tensorboard", "mlflow", "plot"):
        assert feature in everything
    assert "nexrl[all]" in extras["dev"]  # `pip install -e ".[dev]"` keeps everything


def test_every_base_dependency_is_imported_somewhere() -> None:
    source = "\n".join(p.read_text() for p in (ROOT / "nexrl").rglob("*.py"))
    for requirement in PYPROJECT["project"]["dependencies"]:
        name = _name(requirement)
        module = IMPORT_NAMES.get(name, name.replace("-", "_"))
        assert re.search(rf"^\s*(import|from) {module}\b", source, re.M), name


def test_transformers_floor_is_the_release_with_from_pretrained_dtype() -> None:
    """`from_pretrained(dtype=...)` replaced `torch_dtype` in transformers 4.56; older
    releases silently ignore `dtype` (the model loads in its saved dtype)."""
    source = "\n".join(p.read_text() for p in (ROOT / "nexrl").rglob("*.py"))
    assert re.search(r"from_pretrained\([^)]*\bdtype=", source)
    floor = next(r for r in PYPROJECT["project"]["dependencies"] if _name(r) == "transformers")
    assert ">=4.56" in floor


def test_the_local_entry_points_import_no_optional_package() -> None:
    code = (
        "import sys, nexrl.cli, nexrl.controller, nexrl.builders, nexrl.plot, nexrl.monitoring;"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(OPTIONAL)!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_import_hint_names_the_extra_or_the_user_module_path() -> None:
    from nexrl.cli import import_hint

    hint = import_hint(ModuleNotFoundError("No module named 'ray'", name="ray"))
    assert hint == "No module named 'ray': pip install 'nexrl[ray]'"
    user = import_hint(ModuleNotFoundError("No module named 'my_rewards'", name="my_rewards"))
    assert "looked up from the current folder" in user


def _venv_without(tmp_path: Path, hidden: set[str]) -> Path:
    """A venv that sees this one's site-packages except `hidden` distributions (symlinks)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_paths()["purelib"])
    target = next((venv / "lib").glob("python*/site-packages"))
    for entry in site.iterdir():
        stem = re.split(r"-\d", entry.name, maxsplit=1)[0].lower().replace("-", "_")
        if stem not in hidden:
            (target / entry.name).symlink_to(entry)
    return venv / "bin" / "python"


@pytest.mark.slow
def test_a_local_run_trains_without_ray_or_the_server_stack(tmp_path) -> None:
    python = _venv_without(tmp_path, OPTIONAL | {"wandb", "mlflow", "matplotlib"})
    probe = subprocess.run([str(python), "-c", "import ray"], capture_output=True, text=True)
    assert "No module named 'ray'" in probe.stderr
    overrides = [
        "train_worker.total_train_steps=1",
        "rollout_worker.group_size=4",
        "trajectory_pool.batch_size=8",
        "validate.validate_before_train=false",
        "validate.data.max_items=4",
        "logger.backend=[jsonl]",
        f"output_dir={tmp_path / 'out'}",
    ]
    env = {**os.environ, "NEXRL_HOME": str(tmp_path / "home")}
    proc = subprocess.run(
        [str(python), "-m", "nexrl.cli", "train", *overrides],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nexrl: done" in proc.stdout

    def nexrl(*args: str) -> subprocess.CompletedProcess:
        cmd = [str(python), "-m", "nexrl.cli", *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)

    ray_run = nexrl("train", "launch_mode=ray", *overrides)
    assert ray_run.returncode == 2
    assert "No module named 'ray': pip install 'nexrl[ray]'" in ray_run.stderr
    serve = nexrl("serve")
    assert serve.returncode == 2 and "pip install 'nexrl[serve]'" in serve.stderr
