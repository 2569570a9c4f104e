"""Model-based rewards against real components: `nexrl serve` as the judge, a tiny HF classifier."""

from __future__ import annotations

import asyncio
import re
import sys

import httpx
import pytest

from nexrl.rewards.judge import JudgeConfig, JudgeParseError, JudgeReward, parse_score
from nexrl.rewards.reward_model import RewardModelScorer
from nexrl.rewards.runner import RewardRunner
from nexrl.training.parallel import free_port
from tests.servers import spawn


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("Fine.\nScore: 7/10", 0.7),
        ("Score: 3", 0.3),  # no denominator: max_score 10
        ("Score: 4/5 ... final Score: 9/10", 0.9),  # the last one counts
        ("Score: 12/10", 1.0),  # clipped
        ("Score: 2.5 / 5", 0.5),
    ],
)
def test_parse_score(text: str, score: float) -> None:
    assert parse_score(text, JudgeConfig(base_url="x").score_pattern, 10.0) == pytest.approx(score)


def test_parse_score_custom_pattern_and_errors() -> None:
    assert parse_score("[[8]]", r"\[\[(\d+)\]\]", 10) == 0.8
    with pytest.raises(JudgeParseError, match="no score"):
        parse_score("looks good", JudgeConfig(base_url="x").score_pattern, 10)


@pytest.fixture(scope="module")
def serve_url(tiny_model_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "nexrl.cli", "serve", "--model", tiny_model_path]
    proc = spawn([*cmd, "--port", str(port), "--in-process"], url)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def _requests_served(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(v) for v in re.findall(r"^nexrl_requests_total\{[^}]*\} (\S+)", text, re.M))


@pytest.mark.slow
def test_judge_against_nexrl_serve(serve_url) -> None:
    """The tiny model answers garbage: every reply is unparseable and counted, none becomes 0."""
    before = _requests_served(serve_url)
    judge = JudgeReward(JudgeConfig(base_url=serve_url + "/v1", max_tokens=8, chat=False))
    runner = RewardRunner(judge, timeout_s=60)
    try:

        async def many():
            return await asyncio.gather(*(runner.ascore(f"q{i}", "a") for i in range(12)))

        outcomes = asyncio.run(many())
        assert [o.error for o in outcomes] == ["exception"] * 12
        assert all("no score" in o.detail for o in outcomes)
        assert judge.stats == {"requests": 12, "parsed": 0, "unparseable": 12, "request_errors": 0}
        assert _requests_served(serve_url) - before == 12  # they really reached the server
        # the chat endpoint (the judge model's chat template) goes through as well
        chat = JudgeReward(JudgeConfig(base_url=serve_url + "/v1", max_tokens=8, chat=True))
        with RewardRunner(chat, timeout_s=60) as chat_runner:
            chat_outs = [chat_runner.score("q", "a") for _ in range(3)]
        chat.close()
        assert chat.stats["requests"] == 3 and chat.stats["request_errors"] == 0
        assert sum(o.ok for o in chat_outs) == chat.stats["parsed"]
        assert _requests_served(serve_url) - before == 15
    finally:
        runner.close()
        judge.close()


@pytest.mark.slow
def test_judge_request_failures_are_counted() -> None:
    judge = JudgeReward(JudgeConfig(base_url=f"http://127.0.0.1:{free_port()}/v1"))
    try:
        with RewardRunner(judge, timeout_s=30) as runner:
            out = runner.score("q", "a")
        assert out.error == "exception" and "Connection" in out.detail
        assert judge.stats["request_errors"] == 1
    finally:
        judge.close()


def test_judge_template_errors_name_the_field() -> None:
    judge = JudgeReward(JudgeConfig(base_url="http://127.0.0.1:9/v1", template="{rubric}"))
    try:
        with pytest.raises(KeyError, match="rubric"):
            judge.score("q", "a", answer="x")
    finally:
        judge.close()


@pytest.fixture(scope="module")
def classifier_path(tmp_path_factory):
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from nexrl.models.tiny import build_char_tokenizer

    path = tmp_path_factory.mktemp("rm")
    tok = build_char_tokenizer(path)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(str(path))
    return str(path)


def test_reward_model_batches_concurrent_calls(classifier_path) -> None:
    rm = RewardModelScorer(classifier_path, batch_size=8, max_wait_s=0.2)
    try:
        alone = [rm.score("q:", c) for c in ("abc", "abcdef")]
        assert rm.stats["forwards"] == 2 and alone[0] != alone[1]

        async def many():
            return await asyncio.gather(*(rm("q:", c) for c in ("abc", "abcdef") * 8))

        outs = asyncio.run(many())
        # batched scores (with padding) equal the one-at-a-time scores
        assert [o["reward"] for o in outs[:2]] == pytest.approx(alone, abs=1e-5)
        assert outs[0]["scores"] == {"reward_model": outs[0]["reward"]}
        assert rm.stats["max_batch"] > 1 and rm.stats["forwards"] < 2 + 16
    finally:
        rm.close()
