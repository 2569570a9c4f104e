"""Every benchmark script runs its `--smoke` mode to the end (issue 16).

A benchmark that nobody runs rots: bench_training.py crashed for weeks after the
vocabulary shrank. Each script is run as a real subprocess, the way a user runs it,
and must exit 0 and print its headline figure. Results files are not written in
smoke mode (bench_rewards writes into a temporary folder).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def run_smoke(script: str, *extra: str, timeout: float = 600) -> str:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--smoke", *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"{script} --smoke failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def load_bench(script: str):
    """The benchmark script as a module (it imports `_machine` from beside it)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(script[:-3], BENCH / script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


SMOKE_LINES = {
    "bench_training.py": "engine_vs_bare_loop:",
    "bench_generation.py": "smoke: speedup_vs_hf_at_4:",
    "bench_e2e.py": "nexrl_sync_vs_minimal_step_s:",
    "bench_async.py": "fully_async_vs_sync_emulated:",
    "bench_rewards.py": "math",
    "bench_ray.py": "ray_vs_local_wallclock:",
    "bench_validation.py": "validation_concurrency_speedup:",
    "bench_startup.py": "process_vs_builtin_first_step:",
    "bench_host.py": "nexrl_host_vs_minimal:",
    "bench_soak.py": "soak_lost_duplicated: 0 0",
    "bench_memory.py": "peak_rss_gib_at_largest:",
    "bench_trl.py": "nexrl_step_s:",
}


def test_every_benchmark_has_a_smoke_test() -> None:
    scripts = {p.name for p in BENCH.glob("bench_*.py")}
    assert scripts == set(SMOKE_LINES), "add the new benchmark to SMOKE_LINES"


@pytest.mark.slow
@pytest.mark.parametrize(
    "script",
    [
        "bench_training.py",
        "bench_generation.py",
        "bench_async.py",
        "bench_validation.py",
        "bench_startup.py",
        "bench_host.py",
        "bench_memory.py",
        "bench_trl.py",  # the tiny model; TRL's side where this Python has trl
    ],
)
def test_smoke_mode_runs(script: str, tmp_path: Path) -> None:  # bench_e2e.py: below
    before = {p: p.stat().st_mtime for p in (BENCH / "results").glob("*")}
    out = run_smoke(script, "--out", str(tmp_path))
    assert SMOKE_LINES[script] in out
    if script == "bench_trl.py":  # held-out accuracy before training and after each step
        row = next(line for line in out.splitlines() if line.startswith("| nexrl sync |"))
        assert len(row.split("|")[5].split()) == 3, row
    after = {p: p.stat().st_mtime for p in (BENCH / "results").glob("*")}
    assert after == before, "smoke mode must not touch benchmarks/results"


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "chat"), [("float32", False), ("bfloat16", True)])
def test_generation_smoke_mode_on_smollm2(
    smollm2_dir, tmp_path: Path, dtype: str, chat: bool
) -> None:
    args = ["--smollm2", "--model-path", smollm2_dir, "--dtype", dtype, "--out", str(tmp_path)]
    out = run_smoke("bench_generation.py", *args, *(["--chat"] if chat else []))
    if dtype != "float32":  # HF generate in fp32 measured beside both bf16 sides
        assert "hf fp32" in out
    if chat:  # chat-template prompts: the engine also measured without its prefix cache
        assert "engine without prefix cache" in out
    assert "smoke: smollm2_speedup_vs_hf_at_2:" in out
    assert not list(tmp_path.iterdir())  # smoke mode writes no results


@pytest.mark.slow
def test_validation_smoke_mode_on_the_agent_recipe(smollm2_dir, tmp_path: Path) -> None:
    out = run_smoke("bench_validation.py", "--calculator", "--model-path", smollm2_dir)
    assert SMOKE_LINES["bench_validation.py"] in out
    assert "concurrency 8 [" in out  # the side with validation tasks side by side ran


@pytest.mark.slow
def test_rewards_smoke_mode_runs(tmp_path: Path) -> None:
    out = run_smoke("bench_rewards.py", "--out", str(tmp_path))
    assert SMOKE_LINES["bench_rewards.py"] in out
    assert "cores" in (tmp_path / "rewards_smoke.md").read_text()
    payload = json.loads((tmp_path / "rewards_smoke.json").read_text())
    assert payload["machine"]["cores"] == os.cpu_count()
    assert _json_names_machine_and_command(payload)


@pytest.mark.slow
@pytest.mark.ray
def test_ray_smoke_mode_runs() -> None:
    out = run_smoke("bench_ray.py", "--layouts", "one_actor", "rollout_train")
    assert SMOKE_LINES["bench_ray.py"] in out
    assert "ray_rollout_train_vs_local_wallclock:" in out


@pytest.mark.slow
def test_soak_smoke_mode_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    """One kill of each kind (the run, the trainer, the engine) and resumes: every item
    trained exactly once (the full mode's 24 kills: docs/reliability.md)."""
    out = run_smoke("bench_soak.py", "--out", str(tmp_path))
    assert SMOKE_LINES["bench_soak.py"] in out
    assert "'kills_run': 1, " in out and "'kills_engine': 1" in out, out[-2000:]
    assert "'trainer_kill_stopped_run': 1" in out, out[-2000:]
    assert not list(tmp_path.iterdir())  # smoke mode writes no results


@pytest.mark.slow
def test_e2e_smoke_mode_with_several_seeds(tmp_path: Path) -> None:
    before = {p: p.stat().st_mtime for p in (BENCH / "results").glob("*")}
    out = run_smoke("bench_e2e.py", "--seeds", "2", "--out", str(tmp_path))
    assert "'s_to_target_runs': [" in out  # the medians name each run's time to target
    assert SMOKE_LINES["bench_e2e.py"] in out
    after = {p: p.stat().st_mtime for p in (BENCH / "results").glob("*")}
    assert after == before and not list(tmp_path.iterdir())  # smoke mode writes no results


@pytest.mark.slow
def test_e2e_smoke_mode_on_the_micro_model(tmp_path: Path) -> None:
    bench = load_bench("bench_e2e.py")
    config = json.loads((bench.micro_model_path() / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (16, 1)
    out = run_smoke("bench_e2e.py", "--model", "micro", "--threads", "1", "--out", str(tmp_path))
    assert f"model: {bench.micro_model_path()}" in out  # both sides train it
    assert "torch threads: 1" in out  # `--threads` sets the process's count
    assert SMOKE_LINES["bench_e2e.py"] in out and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_async_smoke_mode_on_one_engine_and_task(tmp_path: Path) -> None:
    out = run_smoke("bench_async.py", "--only", "emulated/long_tail", "--out", str(tmp_path))
    assert "## emulated / long_tail" in out and "## emulated / default" not in out
    assert "fully_async_vs_sync_emulated:" in out
    assert not list(tmp_path.iterdir())  # smoke mode writes no results


def gpu_sh_commands() -> list[list[str]]:
    """The `bench NAME SECONDS SCRIPT ARGS...` lines of benchmarks/gpu.sh, as argv lists
    (SCRIPT first), its shell variables left as words."""
    text = (BENCH / "gpu.sh").read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines()]
    return [shlex.split(ln)[3:] for ln in lines if ln.startswith("bench ")]


def test_gpu_script_passes_only_options_its_benchmarks_take() -> None:
    """gpu.sh runs only on a lent GPU, so CI checks its command lines against each
    script's own parser: a renamed or removed option fails here, not on the GPU."""
    commands = gpu_sh_commands()
    assert {c[0] for c in commands} == {"bench_generation.py", "bench_training.py", "bench_e2e.py"}
    assert len(commands) == 7  # 3 smoke lines, 4 full ones
    for script, *args in commands:
        load_bench(script).parser().parse_args(args)  # SystemExit (exit 2) if unknown


# -- results files name the machine and the command -------------------------------------

MACHINE = re.compile(r"(Machine|CPU|lscpu)[^\n]*?(AMD|Intel|EPYC|Xeon|not recorded)", re.I)
COMMAND = re.compile(
    r"`(python3? |nexrl |bash )[^`]+`|^ {4}(nice -n \d+ )?(python3? |nexrl )", re.M
)


def _json_names_machine_and_command(payload: dict) -> bool:
    """At the top, or in each of the runs a file collects (one per top-level key)."""
    if "command" not in payload and payload and all(isinstance(v, dict) for v in payload.values()):
        return all(map(_json_names_machine_and_command, payload.values()))
    machine = payload.get("machine") or payload.get("cpu")
    if isinstance(machine, dict):
        machine = machine.get("cpu")
    return bool(machine) and bool(payload.get("command"))


@pytest.mark.parametrize("path", sorted((BENCH / "results").glob("*.*")), ids=lambda p: p.name)
def test_every_results_file_names_the_machine_and_the_command(path: Path) -> None:
    """Figures from different machines are not comparable, and a figure without its
    command cannot be re-measured: every committed results file says both."""
    if path.suffix == ".md":
        text = path.read_text()
        assert MACHINE.search(text), f"{path.name} names no CPU model"
        assert COMMAND.search(text), f"{path.name} names no command"
    elif path.suffix == ".json":
        assert _json_names_machine_and_command(json.loads(path.read_text())), path.name
    else:
        assert path.suffix == ".png", f"unexpected results file {path.name}"


def test_json_results_start_with_the_machine_and_the_command(tmp_path: Path) -> None:
    """What a benchmark writes, not only what was committed: bench_async's writer."""
    write = load_bench("bench_async.py")._write
    write(tmp_path, {}, {"a_vs_b": 1.0}, [], 0.01, quick=True, name="probe")
    payload = json.loads((tmp_path / "probe.json").read_text())
    assert list(payload)[:2] == ["machine", "command"]
    assert payload["machine"]["cores"] == os.cpu_count() and payload["machine"]["cpu"]
    assert payload["command"].startswith("python ")
    assert _json_names_machine_and_command(payload)
    assert MACHINE.search((tmp_path / "probe.md").read_text())
