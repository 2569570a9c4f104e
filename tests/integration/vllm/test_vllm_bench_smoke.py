"""bench_generation.py --vllm --smoke: nexrl serve, vLLM and HF generate on SmolLM2 chats."""

from __future__ import annotations

import re

import pytest

from tests.test_benchmarks_smoke import run_smoke

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]  # a start: 30 s-10 min


def test_generation_benchmark_compares_vllm(smollm2_dir):
    out = run_smoke("bench_generation.py", "--vllm", "--model-path", smollm2_dir, timeout=1800)
    for server in ("nexrl", "vllm", "hf"):
        assert re.search(rf"^{server}\s+c=\s*4\s+[\d.]+ tok/s", out, re.M), out
    ratio = float(re.search(r"smoke: vllm_vs_nexrl_at_4: ([\d.]+)", out).group(1))
    assert ratio > 0
