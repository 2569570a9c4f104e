"""A trajectory written with the response text only (seed 000's worker) gets the token ids,
logprobs and prompt of its own sample, even when concurrent episodes answer the same
text: "" and one-character strings are one shared object each in CPython, so the text
object cannot name the sample; the client's `SampleText` does."""

from __future__ import annotations

import itertools
import pickle

import pytest

from nexrl import AgentRolloutWorker, RolloutWorkflow
from nexrl.config.schema import RolloutWorkerConfig
from nexrl.inference.client import LLMServiceClient, SampleText
from nexrl.inference.protocol import GenerationRequest, SamplingParams
from tests.rollout_parts import build_rollout_side


@pytest.fixture
def client(tiny_model_path):
    return LLMServiceClient({"backend": "builtin", "model": tiny_model_path, "model_tag": "t"})


class ShortAnswers(RolloutWorkflow):
    """Episode k asks `data["prompts"][k % 2]` for a short answer and returns only its text,
    as a user trajectory does; `seen[k]` is what the engine really sampled for it."""

    def __init__(self, sampling: SamplingParams) -> None:
        self.sampling = sampling
        self.count = itertools.count()
        self.seen: dict[int, tuple[list[int], list[int], list[float]]] = {}

    async def arun_episode(self, engine, data):
        k = next(self.count)
        prompt = data["prompts"][k % 2]
        ids = list(engine.tokenizer(prompt)["input_ids"])
        out = (await engine.agenerate(GenerationRequest(ids, self.sampling))).outputs[0]
        self.seen[k] = (ids, list(out.output_ids), list(out.output_logprobs))
        return {"prompt": prompt, "response": out.text, "episode": k, "reward": 0.0}


def two_prompts_with_one_greedy_char(client) -> tuple[list[str], str]:
    """Two prompts whose greedy one-token answers are the same character."""
    by_answer: dict[str, str] = {}
    for a, b in itertools.product("abcdefghij", repeat=2):
        text = client.completion(f"{a}{b}>", max_tokens=1, temperature=0.0)["response"]
        if len(text) == 1 and text in by_answer:
            return [by_answer[text], f"{a}{b}>"], text
        by_answer.setdefault(text, f"{a}{b}>")
    raise AssertionError("no two prompts share a greedy answer")


def run_group(client, prompts: list[str], sampling: SamplingParams):
    workflow = ShortAnswers(sampling)

    class Worker(AgentRolloutWorker):
        def __init__(self, config, llm_client, context, reward_fn=None):
            super().__init__(config, llm_client, context, reward_fn, workflow=workflow)

    cfg = RolloutWorkerConfig(group_size=4, max_tokens=4, max_task_retries=0)
    items = [{"prompt": prompts[0], "prompts": prompts, "uid": "u0"}]
    side = build_rollout_side(client, items, None, worker=cfg, worker_cls=Worker)
    try:
        assert side.worker._loop_once()
        batch = side.pool.get_batch()
        assert batch is not None, side.tracker.error_reporter.get_errors()
    finally:
        side.worker.stop()
    return batch, workflow.seen


def assert_own_samples(batch, seen) -> None:
    v = batch.values
    for k, prompt_ids, ids, logprobs in zip(
        v["episode"], v["prompt_ids"], v["response_ids"], v["response_logprobs"], strict=True
    ):
        assert (prompt_ids, ids, logprobs) == seen[k], f"episode {k} got another sample"


def test_episodes_that_all_answer_the_empty_string_keep_their_own_samples(client):
    every_char = [client.tokenizer.decode([i]) for i in range(4, len(client.tokenizer))]
    stop_at_once = SamplingParams(max_new_tokens=1, temperature=1.0, stop=every_char)
    batch, seen = run_group(client, ["abcd>", "wxyz>"], stop_at_once)
    assert batch.values["response"] == [""] * 4  # the same interned object four times
    assert len({tuple(s[0]) for s in seen.values()}) == 2  # two prompts, two prompt_ids
    assert_own_samples(batch, seen)


def test_episodes_that_answer_the_same_character_keep_their_own_samples(client):
    prompts, char = two_prompts_with_one_greedy_char(client)
    batch, seen = run_group(client, prompts, SamplingParams(max_new_tokens=1, temperature=0.0))
    assert batch.values["response"] == [char] * 4
    assert len({tuple(s[0]) for s in seen.values()}) == 2  # two prompts, two prompt_ids
    assert_own_samples(batch, seen)


def test_only_the_returned_text_object_names_its_sample(client):
    result = client.completion("abcd>", max_tokens=1, temperature=0.0)
    text = result["response"]
    assert isinstance(text, SampleText) and text is result["choices"][0]["response"]
    assert client.sample_of(text)["response_ids"] == result["response_ids"]
    assert client.sample_of(pickle.loads(pickle.dumps(text)))["prompt_ids"] == result["prompt_ids"]
    assert client.sample_of(str(text)) is None  # equal text is not the sample
    again = client.completion("abcd>", max_tokens=1, temperature=0.0)["response"]
    assert again == text and again.sample_id != text.sample_id
