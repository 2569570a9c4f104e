"""User code written the seeds' way, against the real engine, task owner, loader and pool:
it trains, or fails at once with one line naming the problem; no task is lost."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

import pytest
import torch

from nexrl import (
    AgentRolloutWorker,
    BaseDataLoader,
    BaseRolloutWorker,
    NexRLController,
    RolloutWorkflow,
    SingleTurnRolloutWorker,
    Task,
)
from nexrl.config.schema import RolloutWorkerConfig
from nexrl.inference.client import LLMServiceClient
from nexrl.inference.protocol import GenerationRequest, SamplingParams
from nexrl.rewards import shift_letters
from tests.rollout_parts import build_rollout_side


@pytest.fixture
def client(tiny_model_path):
    return LLMServiceClient({"backend": "builtin", "model": tiny_model_path, "model_tag": "t"})


ITEMS = [{"prompt": "abcd>", "answer": "bcde", "uid": "u0"}]


def seed_step(self, task: dict[str, Any]) -> str | None:
    """Seed 000's "Custom RolloutWorker Implementation", verbatim."""
    if "prompt" not in task:
        return None
    prompt = task["prompt"]
    result = self._llm_client.completion(prompt, temperature=0.7)
    trajectory = {
        "prompt": prompt,
        "response": result["response"],
        "finish_reason": result["finish_reason"],
        "custom_metadata": task.get("metadata", {}),
        "model_tag": self._llm_client._model_tag,
    }
    return self._put_trajectory(trajectory)


class SeedWorker(BaseRolloutWorker):
    step = seed_step


class SeedAgentWorker(AgentRolloutWorker):
    step = seed_step


@pytest.mark.parametrize("worker_cls", [SeedWorker, SeedAgentWorker])
def test_a_one_trajectory_step_fills_the_group(client, worker_cls):
    """Under group_size 4 the step is called 4 times for the task: one group, no wait."""
    side = build_rollout_side(client, ITEMS, shift_letters, worker_cls=worker_cls)
    assert side.worker._loop_once()
    batch = side.pool.get_batch()
    assert batch is not None and len(batch) == 4 and set(batch.values["uid"]) == {"0-0"}
    for text, ids in zip(batch.values["response"], batch.values["response_ids"], strict=True):
        assert client.tokenizer.decode(ids, skip_special_tokens=True) == text  # its own sample
    assert all(r is not None for r in batch.values["reward"])  # scored by reward_fn
    assert side.tracker.get_counters().get("tasks_failed/train", 0) == 0


class CopiesTheText(BaseRolloutWorker):
    def step(self, task):
        result = self._llm_client.completion(task["prompt"], max_tokens=4)
        text = "".join(list(result["response"]))  # equal text, another object
        return self._put_trajectory({"prompt": task["prompt"], "response": text})


def test_token_ids_come_from_the_result_not_from_equal_text(client):
    cfg = RolloutWorkerConfig(group_size=1, max_tokens=4, max_task_retries=0)
    side = build_rollout_side(client, ITEMS, shift_letters, worker=cfg, worker_cls=CopiesTheText)
    assert side.worker._loop_once()
    assert side.pool.is_empty()
    message = side.tracker.error_reporter.get_errors()[0].message
    assert "missing ['prompt_ids', 'response_ids'" in message


class TooMany(BaseRolloutWorker):
    def step(self, task):
        result = self._llm_client.completion(task["prompt"], n=5, max_tokens=4)
        return self._put_trajectory_group([{**c, **result, **c} for c in result["choices"]])


class PutsNothing(BaseRolloutWorker):
    def step(self, task):
        return "success"


@pytest.mark.parametrize(
    ("worker_cls", "message"),
    [
        (TooMany, "TooMany.step on task '0-0' put 5 episodes but rollout_worker.group_size=4"),
        (PutsNothing, "PutsNothing.step on task '0-0' returned success but put no trajectory"),
    ],
)
def test_a_wrong_group_is_an_error_then_a_counted_failure(client, worker_cls, message):
    cfg = RolloutWorkerConfig(group_size=4, max_tokens=4, max_task_retries=1)
    side = build_rollout_side(client, ITEMS, shift_letters, worker=cfg, worker_cls=worker_cls)
    assert side.worker._loop_once() and side.worker._loop_once()  # the try, then the retry
    errors = side.tracker.error_reporter.get_errors()
    assert [e.exception_type for e in errors] == ["GroupSizeError"] * 2
    assert message in errors[0].message
    assert side.pool.is_empty() and len(side.loader) == 0
    assert side.tracker.get_counters()["tasks_failed/train"] == 1


class SeedLoader(BaseDataLoader):
    """A loader written to seed 000's contract: its own list, its own get_next_item."""

    def __init__(self, config, is_validate: bool = False):
        super().__init__(config, is_validate)
        self.items = list(config["items"])
        self.pos = 0

    def __len__(self) -> int:
        return len(self.items) - self.pos

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.items[index]

    def get_next_item(self) -> dict[str, Any] | None:
        if self.pos >= len(self.items):
            return None
        self.pos += 1
        return self.items[self.pos - 1]

    def is_finished(self) -> bool:
        return self.pos >= len(self.items)

    def can_return_item(self) -> bool:
        return not self.is_finished()

    def reset(self) -> None:
        self.pos = 0


def test_a_seed_loader_serves_the_tasks_given_back_first():
    loader = SeedLoader({"items": [{"prompt": "a"}, {"prompt": "b"}]})
    first = loader.get_next_item()
    loader.add_item_front(first)
    assert len(loader) == 2 and not loader.is_finished()
    again = loader.get_next_item()
    assert isinstance(again, Task) and again["prompt"] == "a"
    assert loader.get_next_item()["prompt"] == "b" and loader.is_finished()
    loader.add_item_back({"prompt": "c"})
    assert not loader.is_finished()
    loader.reset()
    assert len(loader) == 2


def test_a_seed_loader_loses_no_retried_task(client):
    """Every task's first reward fails: each is retried through the user's loader and
    trained the second time; none is counted failed, none is lost."""
    items = [{"prompt": f"{w}>", "answer": w, "uid": f"u{i}"} for i, w in enumerate("abcd")]
    failed_once: set[str] = set()

    def flaky(prompt, completion, **row):
        if row["uid"] not in failed_once:
            failed_once.add(row["uid"])
            raise RuntimeError("first try fails")
        return 1.0

    cfg = RolloutWorkerConfig(group_size=2, max_tokens=2, max_task_retries=1)
    loader = SeedLoader({"items": items})
    side = build_rollout_side(client, items, flaky, worker=cfg, loader=loader, gpb=4)
    while side.worker._loop_once():
        pass
    assert loader.is_finished() and len(loader) == 0
    batch = side.pool.get_batch()
    assert batch is not None and sorted(set(batch.values["uid"])) == ["u0", "u1", "u2", "u3"]
    counters = side.tracker.get_counters()
    assert counters["rollout/released/fail"] == 4 and "tasks_failed/train" not in counters


class SlowFirstStep(SingleTurnRolloutWorker):
    """A worker whose first training task takes 3 s (a slow tool, a slow reward)."""

    slept = False

    def step(self, task):
        if not task.is_validate and not SlowFirstStep.slept:
            SlowFirstStep.slept = True
            time.sleep(3.0)
        return super().step(task)


@pytest.mark.slow
def test_a_run_without_steps_says_what_it_waits_for(small_config, caplog):
    cfg = small_config(
        f"rollout_worker.type={__name__}:SlowFirstStep",
        "rollout_worker.num_workers=1",
        "trajectory_pool.batch_size=4",
        "train_worker.total_train_steps=1",
        "validate.validate_before_train=false",
        "runtime_monitor.stall_report_s=1.0",
    )
    with caplog.at_level(logging.WARNING, logger="nexrl"):
        NexRLController(cfg).run()
    reports = [r.getMessage() for r in caplog.records if "no train step for" in r.getMessage()]
    assert reports, "no stall report"
    assert "pool: no trajectory has arrived yet" in reports[0]
    assert (
        "in flight: rollout_worker_0: rollout (" in reports[0]
        and "last error: no recent errors" in reports[0]
    )


@pytest.mark.slow
def test_the_run_ends_with_where_every_task_went(small_config, capsys):
    from nexrl.cli import run_training

    cfg = small_config(
        "train_worker.total_train_steps=1",
        "validate.validate_before_train=false",
        "trajectory_pool.batch_size=8",
    )
    assert run_training(cfg) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("nexrl: tasks: "))
    handed, trained, failed, dropped, left = map(
        int, re.findall(r"(\d+) (?:handed|trained|failed|dropped|not)", line)
    )
    assert trained == 2 and failed == 0
    assert handed == trained + failed + dropped + left


class LoopBoundWorkflow(RolloutWorkflow):
    """Opens something bound to the episodes' loop; its close hook must run there."""

    def __init__(self) -> None:
        self.loops: set[int] = set()
        self.closed_on: int | None = None

    async def arun_episode(self, engine, data):
        self.loops.add(id(asyncio.get_running_loop()))
        resp = await engine.agenerate(
            GenerationRequest(engine.tokenizer(data["prompt"])["input_ids"], SamplingParams(4))
        )
        out = resp.outputs[0]
        return {
            "prompt_ids": list(resp.input_ids),
            "response_ids": list(out.output_ids),
            "response_logprobs": list(out.output_logprobs),
            "token_versions": list(out.output_versions),
            "finish_reason": out.finish_reason,
            "response": out.text,
        }

    async def aclose(self) -> None:
        self.closed_on = id(asyncio.get_running_loop())


def test_the_agent_worker_closes_its_workflow_on_the_episodes_loop(client):
    workflow = LoopBoundWorkflow()

    class Worker(AgentRolloutWorker):
        def __init__(self, config, llm_client, context, reward_fn=None):
            super().__init__(config, llm_client, context, reward_fn, workflow=workflow)

    side = build_rollout_side(client, ITEMS, shift_letters, worker_cls=Worker)
    assert side.worker._loop_once()
    assert len(side.pool.get_batch()) == 4  # the workflow's dicts had no loss_mask: filled
    side.worker.stop()
    assert workflow.closed_on is not None and {workflow.closed_on} == workflow.loops


class TensorDictWorkflow:
    """Seed 004's workflow shape: a plain class whose episode returns AReaL's tensor dict
    (input_ids, loss_mask, logprobs, versions, rewards, attention_mask; shape (1, L))."""

    async def arun_episode(self, engine, data):
        prompt = list(engine.tokenizer(data["prompt"])["input_ids"])
        out = (await engine.agenerate(GenerationRequest(prompt, SamplingParams(4)))).outputs[0]
        n, m = len(prompt), len(out.output_ids)
        return {
            "input_ids": torch.tensor([prompt + list(out.output_ids)]),
            "loss_mask": torch.tensor([[0] * n + [1] * m]),
            "logprobs": torch.tensor([[0.0] * n + list(out.output_logprobs)]),
            "versions": torch.tensor([[-1] * n + list(out.output_versions)]),
            "rewards": torch.tensor([0.5]),
            "attention_mask": torch.ones(1, n + m, dtype=torch.long),
        }


class BareDictWorkflow:
    """A trajectory dict with ids and logprobs only: no loss_mask, no versions, no text."""

    async def arun_episode(self, engine, data):
        prompt = list(engine.tokenizer(data["prompt"])["input_ids"])
        out = (await engine.agenerate(GenerationRequest(prompt, SamplingParams(4)))).outputs[0]
        return {
            "prompt_ids": prompt,
            "response_ids": list(out.output_ids),
            "response_logprobs": list(out.output_logprobs),
        }


@pytest.mark.parametrize("workflow_cls", [TensorDictWorkflow, BareDictWorkflow])
def test_seed_004_episode_outputs_train(client, workflow_cls):
    class Worker(AgentRolloutWorker):
        def __init__(self, config, llm_client, context, reward_fn=None):
            super().__init__(config, llm_client, context, reward_fn, workflow=workflow_cls())

    side = build_rollout_side(client, ITEMS, shift_letters, worker_cls=Worker)
    assert side.worker._loop_once()
    batch = side.pool.get_batch()
    assert batch is not None and len(batch) == 4, side.tracker.error_reporter.get_errors()
    for ids, mask, text in zip(
        batch.values["response_ids"],
        batch.values["loss_mask"],
        batch.values["response"],
        strict=True,
    ):
        assert (
            mask == [1] * len(ids)
            and client.tokenizer.decode(ids, skip_special_tokens=True) == text
        )
    assert all(v == 0 for v in batch.values["model_version"]) or "token_versions" in batch.values
    if workflow_cls is TensorDictWorkflow:
        assert batch.values["reward"] == [0.5] * 4
    side.worker.stop()


def test_text_the_tokenizer_cannot_encode_is_warned_once(client, caplog):
    items = [{"prompt": "héllo>", "answer": "x", "uid": "u0"}]
    side = build_rollout_side(client, items, shift_letters)
    with caplog.at_level(logging.WARNING):
        assert side.worker._loop_once()
        again = client.tokenizer("ä>")["input_ids"]
        assert not side.worker.warn_unknown_tokens(again, Task(data={"uid": "u1"}))  # once
    warned = [r.getMessage() for r in caplog.records if "unknown token" in r.getMessage()]
    assert warned == [
        "task '0-0': the tokenizer maps 1 prompt token(s) to its unknown token, so the model "
        "never sees that text; set model_path to a model whose tokenizer covers your data"
    ]


def test_own_data_with_the_builtin_max_tokens_is_warned(tmp_path, caplog):
    from nexrl.data.tasks import warn_own_data_defaults, write_task
    from nexrl.models.tiny import cache_dir

    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"prompt": "Explain RL."}\n')
    builtin, _ = write_task("shift_letters", cache_dir() / "data")
    assert warn_own_data_defaults(str(builtin), 4) is None
    assert warn_own_data_defaults(None, 4) is None
    assert warn_own_data_defaults(str(mine), 256) is None
    message = warn_own_data_defaults(str(mine), 4)
    assert message is not None and "set rollout_worker.max_tokens" in message


def test_mostly_truncated_batches_are_warned(caplog, monkeypatch):
    from nexrl.algorithms import processor

    monkeypatch.setattr(processor, "_truncation_warned", False)
    with caplog.at_level(logging.WARNING):
        assert not processor.warn_if_truncated({"finish_reason": ["stop", "length"]}, 8)
        assert processor.warn_if_truncated({"finish_reason": ["length"] * 3 + ["stop"]}, 8)
        assert not processor.warn_if_truncated({"finish_reason": ["length"]}, 8)  # once
    assert "75% of this batch's completions were cut off at rollout_worker.max_tokens=8" in (
        caplog.text
    )


class TwoChainsWorkflow(BareDictWorkflow):
    """An episode whose turns do not merge (SmolLM2's template drops the tool call): two
    trajectories per episode."""

    async def arun_episode(self, engine, data):
        first = await super().arun_episode(engine, data)
        return [first, {**first, "turn": 1}]


def test_a_group_is_its_episodes_however_many_trajectories_they_made(client):
    class Worker(AgentRolloutWorker):
        def __init__(self, config, llm_client, context, reward_fn=None):
            super().__init__(config, llm_client, context, reward_fn, workflow=TwoChainsWorkflow())

    items = [{"prompt": "abcd>", "answer": "bcde"}, {"prompt": "wxyz>", "answer": "xyza"}]
    side = build_rollout_side(client, items, shift_letters, worker_cls=Worker, gpb=2)
    assert side.worker._loop_once() and side.worker._loop_once()
    batch = side.pool.get_batch()  # 2 groups of 4 episodes: 16 trajectories, none waiting
    assert batch is not None and len(batch) == 16 and side.pool.is_empty()
    assert sorted(batch.values["uid"]) == ["0-0"] * 8 + ["0-1"] * 8
    side.worker.stop()
