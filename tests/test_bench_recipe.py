"""bench_generation.py --recipe-steps: a recipe's seconds per step on each backend (smoke:
the default tiny run, built-in engine; the vLLM side runs in tests/integration/vllm)."""

from __future__ import annotations

import re

import pytest

from tests.test_benchmarks_smoke import run_smoke


@pytest.mark.slow
def test_recipe_steps_smoke_reports_each_step_and_validation(tmp_path) -> None:
    out = run_smoke(
        "bench_generation.py",
        "--recipe-steps",
        "2",
        "--backends",
        "builtin",
        "--out",
        str(tmp_path),
    )
    line = re.search(r"^recipe builtin\s+([\d.]+) s/step .* val 0:[\d.]+ 2:[\d.]+$", out, re.M)
    assert line and float(line.group(1)) > 0, out
    assert "smoke: recipe_steps_done: 2" in out
    assert not list(tmp_path.iterdir())  # smoke mode writes no results
