"""Benchmark: the interpreter's work between samples and a train batch, per step.

    python benchmarks/bench_host.py            # seconds
    python benchmarks/bench_host.py --smoke    # a few repeats, no results file

What a step of the default recipe (16 prompts x 16 samples of up to 4 tokens)
costs in Python once the engine has answered, on each side of bench_e2e.py:

- nexrl: each group through a rollout worker's real `step` - the client (prompt
  encoding, the request, its result and recent samples), the reward, the
  trajectories, the trajectory pool - then the batch through the real GRPO
  processor into the train batch pool. The engine is a canned one: it answers every
  request with samples prepared beforehand (bench_generation.py times generation),
  so only the host's bookkeeping is left.
- minimal: the minimal loop's own lines for the same 256 texts: the reward per
  sample, then group-normalised advantages.

One thread, no other work in the process: each figure is the best of `--repeats`
runs of `--steps` steps. In a training run these costs are paid under one
interpreter lock, beside the engine's scheduler thread and (in-process) the
trainer's: on a GPU, where the engine's decode waits on the device, they are what
the rollout side's time above the minimal loop's is made of (docs/performance.md).

Writes host.md into --out (default ./bench_results; not in --smoke). Last line:
`nexrl_host_vs_minimal: X` (nexrl's seconds / the minimal loop's, per step).
"""

from __future__ import annotations

import argparse
import random
import timeit
from concurrent.futures import Future
from typing import Any

from _machine import add_out_arguments, prepend_section, results_dir, section_head
from bench_e2e import GROUP, PROMPTS, group_advantages
from transformers import AutoTokenizer

from nexrl.algorithms.processor import GRPOProcessor, ProcessorContext
from nexrl.config.schema import AlgorithmConfig, RolloutWorkerConfig, TrajectoryPoolConfig
from nexrl.inference.client import LLMServiceClient
from nexrl.inference.protocol import GenerationOutput, GenerationRequest, GenerationResponse
from nexrl.models.tiny import default_model_path
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy
from nexrl.pools import TrainBatchPool, TrajectoryPool
from nexrl.rewards import shift_letters
from nexrl.rollout.base import RolloutContext
from nexrl.rollout.workers import SingleTurnRolloutWorker
from nexrl.types import Task

TITLE = "# Host work per step: nexrl's rollout worker, pool and processor vs the minimal loop"
LETTERS = "abcdefghijklmnopqrstuvwxyz"


class CannedEngine:
    """Answers every request with the samples prepared for its prompt (no model)."""

    version = 0

    def __init__(self, tokenizer: Any, answers: dict[tuple[int, ...], list[str]]) -> None:
        self.tokenizer = tokenizer
        self._answers = {
            prompt: [
                GenerationOutput(ids, [-1.0] * len(ids), [0] * len(ids), "length", text)
                for text, ids in ((t, tokenizer.encode(t, add_special_tokens=False)) for t in texts)
            ]
            for prompt, texts in answers.items()
        }

    def submit(self, request: GenerationRequest, on_token: Any = None) -> Future:
        done: Future = Future()
        outputs = self._answers[tuple(request.input_ids)]
        done.set_result(GenerationResponse(list(request.input_ids), outputs, request.rid))
        return done

    def generate(self, request: GenerationRequest) -> GenerationResponse:
        return self.submit(request).result()


def task_rows(steps: int, seed: int = 0) -> list[dict[str, Any]]:
    """`steps` x PROMPTS rows of the shift_letters task, each with GROUP completions of
    1-4 letters (right, wrong, or cut short)."""
    rng = random.Random(seed)
    rows = []
    for i in range(steps * PROMPTS):
        word = "".join(rng.choice(LETTERS) for _ in range(4))
        answer = "".join(LETTERS[(LETTERS.index(c) + 1) % 26] for c in word)
        texts = [answer if rng.random() < 0.5 else answer[: rng.randint(1, 4)][::-1]]
        texts += [rng.choice([answer, word, answer[:2]]) for _ in range(GROUP - 1)]
        row = {"uid": f"t{i}", "index": i, "prompt": f"{word}>", "answer": answer}
        rows.append({**row, "texts": texts})
    return rows


def nexrl_side(rows: list[dict[str, Any]]) -> tuple[Any, ...]:
    """A rollout worker on a client over the canned engine, a trajectory pool, a GRPO
    processor and a train batch pool, wired as in a local run (no threads)."""
    tok = AutoTokenizer.from_pretrained(default_model_path())
    answers = {tuple(tok(r["prompt"])["input_ids"]): r["texts"] for r in rows}
    client = LLMServiceClient({"backend": "builtin"}, engine=CannedEngine(tok, answers))
    tracker = ActivityTrackerProxy(ActivityTracker({}))
    context = RolloutContext("prompt", 0.0, 1, "source", False, 0, False, None)
    config = RolloutWorkerConfig(max_tokens=4, group_size=GROUP)
    worker = SingleTurnRolloutWorker(config, client, context, reward_fn=shift_letters)
    pool = TrajectoryPool(TrajectoryPoolConfig(batch_size=PROMPTS * GROUP, group_size=GROUP))
    batches = TrainBatchPool()
    processor = GRPOProcessor(AlgorithmConfig(), ProcessorContext(PROMPTS * GROUP, 4, 0))
    for module in (worker, pool, processor):
        module.set_activity_tracker(tracker)
    worker.set_module_references(pool, task_admission=None, weight_sync_controller=None)
    processor.set_module_references(pool, batches)
    return worker, pool, processor, batches


def nexrl_steps(parts: tuple[Any, ...], rows: list[dict[str, Any]]) -> None:
    worker, pool, processor, batches = parts
    for start in range(0, len(rows), PROMPTS):
        for i, row in enumerate(rows[start : start + PROMPTS]):
            data = {k: v for k, v in row.items() if k != "texts"}
            task = Task(data=data, task_id=start + i)
            worker.current_task = task
            if worker.step(task) != "success":
                raise RuntimeError(f"task {data['uid']}: the worker's step did not succeed")
        processor._fit(pool.get_batch(), "train")
        batches.get_batch("default")


def minimal_steps(rows: list[dict[str, Any]]) -> None:
    for start in range(0, len(rows), PROMPTS):
        step = rows[start : start + PROMPTS]
        texts = [t for r in step for t in r["texts"]]
        group_advantages(step, texts, GROUP)


def best_per_step(fn: Any, steps: int, repeats: int) -> float:
    return min(timeit.repeat(fn, number=1, repeat=repeats)) / steps


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="steps per timed run")
    p.add_argument("--repeats", type=int, default=15, help="timed runs per side (best kept)")
    p.add_argument("--smoke", action="store_true", help="2 steps, 2 repeats, no results file")
    add_out_arguments(p)
    return p


def main() -> None:
    args = parser().parse_args()
    steps, repeats = (2, 2) if args.smoke else (args.steps, args.repeats)
    rows = task_rows(steps)
    parts = nexrl_side(rows)
    nexrl_steps(parts, rows)  # warm: first calls, imports
    figures = {"nexrl": [], "minimal": []}
    for _ in range(3):  # the two sides alternate, so a drifting machine moves both alike
        figures["nexrl"].append(best_per_step(lambda: nexrl_steps(parts, rows), steps, repeats))
        figures["minimal"].append(best_per_step(lambda: minimal_steps(rows), steps, repeats))
    nexrl_s, minimal_s = min(figures["nexrl"]), min(figures["minimal"])
    lines = [
        f"nexrl: {nexrl_s * 1e3:.3f} ms per step ({nexrl_s / PROMPTS * 1e6:.0f} us per group; "
        f"best of each round: {', '.join(f'{x * 1e3:.3f}' for x in figures['nexrl'])})",
        f"minimal: {minimal_s * 1e3:.3f} ms per step (best of each round: "
        f"{', '.join(f'{x * 1e3:.3f}' for x in figures['minimal'])})",
        f"nexrl_host_vs_minimal: {nexrl_s / minimal_s:.2f}",
    ]
    if not args.smoke:
        head = section_head(f", {steps} steps x {repeats} runs")
        body = [*head, *(f"- {line}" for line in lines), ""]
        prepend_section(results_dir(args) / "host.md", TITLE, body)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
