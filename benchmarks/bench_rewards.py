"""Benchmark: rewards/s under 64 concurrent rollouts, for each built-in reward kind.

    python benchmarks/bench_rewards.py            # a few minutes on 2 CPU cores
    python benchmarks/bench_rewards.py --smoke    # seconds; no judge server

Every figure is `RewardRunner.ascore` called by 64 concurrent asyncio tasks
(the rollout side), so it includes the runner's own overhead:

- `math_numeric`: GSM8K-style completions (`#### n`), numeric path only.
- `math_symbolic`: `\\boxed{...}` fractions/expressions, math-verify in its
  process pool (the calls come from threads, so the off-main-thread path).
- `code_sandboxed`: the default code reward (fork-server bwrap sandbox, warm
  pool of 8) on MBPP-style programs with 3 assert tests each (one sandbox job,
  3 program processes per reward); `code_one_shot` the same with one fresh
  sandbox per job (`Sandbox`); `code_1test_sequential` / `_16_threads` one
  test per reward, 1 or 16 rollouts in flight. With `--baseline REV` the same
  rows for the code reward and sandboxes of git revision REV (`baseline_*`,
  whose default was the one-shot `Sandbox`, one run per test) and the ratios
  `*_vs_baseline`, all measured in the same run. Each row first scores one
  untimed round (one reward per concurrent caller), so sandboxes are started
  as in a job that has been running for a while.
- `reward_model`: a tiny random-init sequence classifier, batched
  (batch_size=32) vs one forward per call (`rm_batched_vs_unbatched`).
- `judge`: the generative judge against `nexrl serve` (tiny built-in model,
  8 new tokens per judgement) as a subprocess; replies are garbage, so the
  figure is judgements/s completed (parsed or counted as unparseable).

Results go to rewards.{md,json} in --out (default ./bench_results), with the CPU
model and the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import add_out_arguments, machine, results_dir

from nexrl.rewards.code import CodeReward
from nexrl.rewards.math import gsm8k_reward, math_reward
from nexrl.rewards.runner import RewardRunner
from nexrl.rewards.sandbox import Sandbox, SandboxLimits
from nexrl.rewards.sandbox_forkserver import ForkServerSandbox

CONCURRENCY = 64
ROW_NOTES = [
    "math_numeric: `gsm8k` reward, `#### n` completions, in-thread.",
    "math_symbolic: `math` reward on \\boxed fractions; math-verify in its process pool.",
    "code_sandboxed: default `code` reward (fork server), 3 assert tests per reward, pool of 8.",
    "code_one_shot: the same with one fresh bwrap sandbox per job; code_1test_*: 1 test per "
    "reward, 1 or 16 rollouts in flight; baseline_*: the same rows for --baseline's code.",
    "reward_model: tiny random Qwen2 classifier, batch_size=32; _unbatched: batch_size=1.",
    "judge: `nexrl serve` tiny model, 8 tokens per judgement; all replies unparseable (garbage "
    "model), so `failed` = 256 is the expected count and rewards/s = judgements completed/s.",
]
BASELINE = "ba593a597e58f8e3c16e6afb1a27d0609c42cf2a"


async def drive(
    runner: RewardRunner, calls: list[tuple[str, str, dict]], concurrency: int = CONCURRENCY
) -> dict[str, Any]:
    """Score `calls` with `concurrency` tasks in flight; rewards/s and failure counts."""
    pending = iter(calls)
    outcomes: list[Any] = []

    async def rollout() -> None:
        for prompt, completion, row in pending:
            outcomes.append(await runner.ascore(prompt, completion, [], [], row))

    start = time.perf_counter()
    await asyncio.gather(*(rollout() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    failed = sum(not o.ok for o in outcomes)
    return {
        "rewards": len(outcomes),
        "seconds": elapsed,
        "per_s": len(outcomes) / elapsed,
        "failed": failed,
        "mean_reward": _mean([o.reward for o in outcomes if o.ok]),
    }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def math_calls(n: int, symbolic: bool) -> list[tuple[str, str, dict]]:
    calls = []
    for i in range(n):
        if symbolic:
            completion = f"so the result is \\boxed{{\\frac{{{2 * i + 2}}}{{{4 * i + 4}}}}}"
            calls.append(("q", completion, {"answer": "\\frac{1}{2}" if i % 2 else "\\frac{1}{3}"}))
        else:
            calls.append(("q", f"{i} + {i} = {2 * i}\n#### {2 * i:,}", {"answer": f"#### {2 * i}"}))
    return calls


def code_calls(n: int, n_tests: int = 3) -> list[tuple[str, str, dict]]:
    tests = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]
    tests = tests[:n_tests]
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    bad = "```python\ndef add(a, b):\n    return a - b\n```"
    return [("q", good if i % 2 else bad, {"tests": tests}) for i in range(n)]


def bench_math(n: int, n_symbolic: int) -> dict[str, Any]:
    out = {}
    with RewardRunner(gsm8k_reward, timeout_s=30) as runner:
        out["math_numeric"] = asyncio.run(drive(runner, math_calls(n, symbolic=False)))
    with RewardRunner(math_reward, timeout_s=60) as runner:
        runner.score("q", "\\boxed{\\frac{1}{2}}", row={"answer": "0.5"})  # warm the pool
        out["math_symbolic"] = asyncio.run(drive(runner, math_calls(n_symbolic, symbolic=True)))
    return out


def load_baseline(rev: str, tmp: Path) -> Any:
    """The code reward and sandboxes as they were at git revision `rev`, as a temp package."""
    root = Path(__file__).resolve().parents[1]
    pkg = tmp / "nexrl_baseline_rewards"
    pkg.mkdir()
    (pkg / "__init__.py").touch()
    for name in ("sandbox", "sandbox_forkserver", "code"):
        src = subprocess.run(
            ["git", "show", f"{rev}:nexrl/rewards/{name}.py"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        (pkg / f"{name}.py").write_text(src.replace("nexrl.rewards.", "nexrl_baseline_rewards."))
    sys.path.insert(0, str(tmp))
    import nexrl_baseline_rewards.code as code
    import nexrl_baseline_rewards.sandbox_forkserver as fork_server

    return code.CodeReward, code.Sandbox, fork_server.ForkServerSandbox


def bench_code(n: int, settle_s: float, baseline: str | None, tmp: Path) -> dict[str, Any]:
    """Default code reward vs the one-shot sandbox, and vs `baseline`'s, in one run."""
    out: dict[str, Any] = {}
    limits = SandboxLimits(wall_s=20, cpu_s=5)
    impls = {"": (CodeReward, Sandbox, ForkServerSandbox)}
    if baseline:
        impls["baseline_"] = load_baseline(baseline, tmp)
    for prefix, (reward_cls, one_shot, fork_server) in impls.items():
        # the new default is the fork server; the baseline's default was the one-shot Sandbox
        default = fork_server if not prefix else one_shot
        runs = [
            ("code_sandboxed", default, 3, CONCURRENCY),
            *([("code_one_shot", one_shot, 3, CONCURRENCY)] if not prefix else []),
            *([("code_fork_server", fork_server, 3, CONCURRENCY)] if prefix else []),
            ("code_1test_sequential", default, 1, 1),
            ("code_1test_16_threads", default, 1, 16),
        ]
        for name, kind, n_tests, concurrency in runs:
            with kind(limits=limits, pool_size=8, max_concurrency=CONCURRENCY) as box:
                time.sleep(settle_s)  # let the warm pool fill, as in a running job
                with RewardRunner(reward_cls(box), timeout_s=120) as runner:
                    # one untimed round: every concurrent caller's sandbox started, as in a
                    # job that has been running for a while
                    warm = code_calls(min(concurrency, n), n_tests)
                    asyncio.run(drive(runner, warm, concurrency))
                    calls = code_calls(n, n_tests)
                    out[prefix + name] = asyncio.run(drive(runner, calls, concurrency))
    if baseline:
        for name in ("code_sandboxed", "code_1test_sequential", "code_1test_16_threads"):
            out[f"{name}_vs_baseline"] = out[name]["per_s"] / out["baseline_" + name]["per_s"]
    return out


def build_classifier(path: Path) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from nexrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer(path)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    Qwen2ForSequenceClassification(config).save_pretrained(str(path))
    return str(path)


def bench_reward_model(n: int, tmp: Path) -> dict[str, Any]:
    from nexrl.rewards.reward_model import RewardModelScorer

    path = build_classifier(tmp / "rm")
    calls = [("question: what is 2+2? answer: ", "4" * (8 + i % 32), {}) for i in range(n)]
    out = {}
    for name, batch in (("reward_model", 32), ("reward_model_unbatched", 1)):
        scorer = RewardModelScorer(path, batch_size=batch, max_wait_s=0.005)
        try:
            with RewardRunner(scorer, timeout_s=120) as runner:
                out[name] = asyncio.run(drive(runner, calls))
            out[name]["forwards"] = scorer.stats["forwards"]
        finally:
            scorer.close()
    out["rm_batched_vs_unbatched"] = (
        out["reward_model"]["per_s"] / out["reward_model_unbatched"]["per_s"]
    )
    return out


def bench_judge(n: int) -> dict[str, Any]:
    import httpx

    from nexrl.models.tiny import default_model_path
    from nexrl.rewards.judge import JudgeConfig, JudgeReward
    from nexrl.training.parallel import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "nexrl.cli",
        "serve",
        "--model",
        str(default_model_path()),
        "--port",
        str(port),
        "--max-batch",
        "64",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("nexrl serve did not start")
            time.sleep(0.5)
        judge = JudgeReward(JudgeConfig(base_url=url + "/v1", chat=False, max_tokens=8))
        try:
            with RewardRunner(judge, timeout_s=120) as runner:
                calls = [(f"question {i}", "answer", {}) for i in range(n)]
                result = asyncio.run(drive(runner, calls))
            result["judge_stats"] = dict(judge.stats)
        finally:
            judge.close()
        result["per_s_completed"] = (judge.stats["parsed"] + judge.stats["unparseable"]) / result[
            "seconds"
        ]
        return {"judge": result}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def write(results: dict[str, Any], out_dir: Path, stem: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(results, indent=2))
    lines = [
        f"# Rewards/s under {CONCURRENCY} concurrent rollouts",
        "",
        f"CPU: {results['machine']['cpu']}, {results['machine']['cores']} cores  ",
        f"Command: `{results['command']}`",
        "",
        "| reward | rewards | seconds | rewards/s | failed | mean reward |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results["figures"].items():
        if isinstance(r, dict):
            lines.append(
                f"| {name} | {r['rewards']} | {r['seconds']:.2f} | {r['per_s']:.1f} | "
                f"{r['failed']} | {r['mean_reward']:.3f} |"
            )
    lines.append("")
    for name, r in results["figures"].items():
        if not isinstance(r, dict):
            lines.append(f"{name}: {r:.2f}")
    lines += ["", "What the rows are (module docstring of benchmarks/bench_rewards.py):", ""]
    lines += [f"- {line.strip()}" for line in ROW_NOTES]
    if "load_average" in results:
        lines += ["", f"1-min load average at the end of the run: {results['load_average']:.1f}."]
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny counts, no judge server")
    add_out_arguments(parser)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="intra-op threads of the reward model (2 threads on a shared 2-core box ran 10x "
        "slower per call than 1: OpenMP barriers wait on descheduled threads)",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        help="git revision whose code reward and sandboxes are measured in the same run "
        f"(the figures in results/ used {BASELINE}, the last commit before the hardening)",
    )
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.torch_threads)
    n_math, n_sym, n_code, n_rm, n_judge = (
        (16, 8, 8, 16, 0)
        if args.smoke
        else (
            2000,
            400,
            256,
            1024,
            256,
        )
    )
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for phase in (
            lambda: bench_math(n_math, n_sym),
            lambda: bench_code(n_code, 0.2 if args.smoke else 2.0, args.baseline, Path(tmp)),
            lambda: bench_reward_model(n_rm, Path(tmp)),
            *([lambda: bench_judge(n_judge)] if n_judge else []),
        ):
            done = phase()
            figures.update(done)
            print("done:", ", ".join(done), flush=True)
    results = {
        "machine": machine(),
        "command": " ".join(
            [
                Path(sys.argv[0]).name if argv is None else "bench_rewards.py",
                *(sys.argv[1:] if argv is None else argv),
            ]
        ),
        "concurrency": CONCURRENCY,
        "torch_threads": args.torch_threads,
        "load_average": os.getloadavg()[0],
        "figures": figures,
    }
    write(results, results_dir(args), "rewards_smoke" if args.smoke else "rewards")
    for name, r in figures.items():
        print(f"{name}: {r['per_s']:.1f}/s" if isinstance(r, dict) else f"{name}: {r:.2f}")
    return results


if __name__ == "__main__":
    main()
