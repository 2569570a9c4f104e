"""`benchmarks/bench_rewards.py --smoke` runs end to end, so the benchmark cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_rewards.py"


@pytest.mark.slow
def test_bench_rewards_smoke(tmp_path) -> None:
    from nexrl.rewards.sandbox import Sandbox, SandboxUnavailableError

    try:
        Sandbox(pool_size=0).close()
    except SandboxUnavailableError as exc:
        pytest.skip(f"sandbox unavailable here: {exc}")
    cmd = [sys.executable, str(BENCH), "--smoke", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, timeout=300)
    results = json.loads((tmp_path / "rewards_smoke.json").read_text())
    figures = results["figures"]
    for name in ("math_numeric", "math_symbolic", "code_sandboxed", "reward_model"):
        assert figures[name]["rewards"] > 0 and figures[name]["failed"] == 0, name
    assert figures["math_numeric"]["mean_reward"] == 1.0
    assert figures["code_sandboxed"]["mean_reward"] == 0.5  # half the programs are wrong
    assert "CPU:" in (tmp_path / "rewards_smoke.md").read_text()
