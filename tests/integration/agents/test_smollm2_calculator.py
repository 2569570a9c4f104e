"""The agent worked example, short: real SmolLM2 GRPO steps through the pipeline with the
calculator tool (the `smollm2_calculator` recipe). Greedy, so every episode is the same:
the model writes a Hermes call, the tool runs, the model answers from its result. The
trajectory is token-exact: each turn was generated from the trajectory so far, its policy
tokens are the engine's ids, the tool's tokens are the template's and have loss_mask 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nexrl import NexRLController
from nexrl.agents.tools import calculator
from nexrl.config import load_config
from nexrl.inference.tool_parsers import get_parser
from tests.integration.agents import workflows

SEEN: list[dict[str, Any]] = []  # (trajectory, the engine calls that built it)


class _RecordingEngine:
    """The worker's engine, keeping each request's ids and the ids it sampled."""

    def __init__(self, engine: Any) -> None:
        self._engine, self.calls = engine, []

    async def agenerate(self, request: Any) -> Any:
        resp = await self._engine.agenerate(request)
        self.calls.append((list(request.input_ids), list(resp.outputs[0].output_ids)))
        return resp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class CalculatorRecorder(workflows.ToolWorkflow):
    async def arun_episode(self, engine, data):
        recording = _RecordingEngine(engine)
        out = await super().arun_episode(recording, data)
        SEEN.extend({"traj": t, "calls": recording.calls, "data": data} for t in out)
        return out


def _spans(mask: list[int]) -> list[tuple[int, int, int]]:
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


QUESTION = {  # greedy SmolLM2 calls the calculator for it (measured)
    "prompt": [{"role": "user", "content": "What is 63 + 29? Answer with the number only."}],
    "answer": "92",
}


@pytest.mark.slow
def test_smollm2_calls_the_calculator_over_two_turns_and_trains(smollm2_dir, tmp_path):
    data = tmp_path / "question.jsonl"
    data.write_text(json.dumps(QUESTION) + "\n")
    cfg = load_config(
        [
            f"output_dir={tmp_path}",
            f"data.path={data}",
            f"validate.data.path={data}",
            f"model_path={smollm2_dir}",
            f"rollout_worker.workflow={__name__}:CalculatorRecorder",
            "rollout_worker.workflow_kwargs.max_turns=2",
            "rollout_worker.num_workers=1",
            "rollout_worker.group_size=2",
            "rollout_worker.temperature=0",
            "trajectory_pool.batch_size=2",
            "train_worker.total_train_steps=2",
            "algorithm.loss_kwargs.entropy_coef=0.01",  # a gradient although rewards tie,
            "train_worker.engine.lr=1e-7",  # too small to change the greedy episode
            "validate.validate_before_train=false",
            "weight.validate_freq=0",
            "logger.backend=[jsonl]",
        ],
        config_name="smollm2_calculator",
    )
    SEEN.clear()
    controller = NexRLController(cfg)
    controller.run()
    lines = (Path(controller.run_dir) / "metrics.jsonl").read_text().splitlines()
    train = [x for x in map(json.loads, lines) if "train/loss" in x]
    assert [x["step"] for x in train] == [1, 2]
    assert all(x["agent/tool_calls"] == 1 and x["agent/parse_failures"] == 0 for x in train)
    assert all(x["agent/turns"] == 2 and x["agent/masked_tokens"] > 200 for x in train)
    assert len(SEEN) >= 4  # 2 steps x 2 episodes (+ validation, + rollouts not yet trained)
    versions = {max(s["traj"]["token_versions"]) for s in SEEN}
    assert {0, 1} <= versions  # episodes after the first push sampled with the new weights
    parser = get_parser("hermes")
    for seen in SEEN:
        traj, calls = seen["traj"], seen["calls"]
        ids = traj["prompt_ids"] + traj["response_ids"]
        mask = [0] * len(traj["prompt_ids"]) + traj["loss_mask"]
        assert 0 in traj["loss_mask"]  # the tool's tokens are in the response, masked
        assert traj["agent_finish"] in ("answer", "max_turns")
        assert all(v >= 0 for v in traj["token_versions"])  # tool tokens: the oldest version
        assert len(calls) == 2  # the call turn and the answer turn
        # each turn was generated from the trajectory so far; its ids are the policy span
        policy = [(s, e) for s, e, m in _spans(mask) if m]
        assert len(policy) == 2
        for (prompt, out), (s, e) in zip(calls, policy, strict=True):
            assert prompt == ids[:s] and out == ids[s:e]
        # the first turn is a parsed call; its executed result sits in the masked tokens
        tok = controller.system.rollout_workers[0]._llm_client.tokenizer
        first = tok.decode(ids[policy[0][0] : policy[0][1]], skip_special_tokens=True)
        _, found, failures = parser.parse(first)
        assert len(found) == 1 and not failures and found[0].name == "calculator"
        result = str(calculator(**found[0].arguments))
        between = tok.decode(ids[policy[0][1] : policy[1][0]])
        assert f"<|im_start|>tool\n{result}<|im_end|>" in between
        assert between.endswith("<|im_start|>assistant\n")
        # the whole sample is what the chat template renders for the episode's messages
        answer = tok.decode(ids[policy[1][0] : policy[1][1]], skip_special_tokens=True)
        wf = controller.system.rollout_workers[0].workflow
        messages = [
            *wf.messages(seen["data"]),
            {"role": "assistant", "content": first},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": answer},
        ]
        rendered = tok.apply_chat_template(messages, tokenize=False)
        assert tok.decode(ids) + "\n" == rendered
        assert traj["reward"] == float(answer.strip() == seen["data"]["answer"])
