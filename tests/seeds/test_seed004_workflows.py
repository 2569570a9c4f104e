"""Seed 004's two `MyRolloutWorkflow` snippets and its reward function, run on nexrl.

The snippets are copied as the seed writes them; every change is marked `# CHANGED:`
with the reason (the seed's `...` are filled in and marked `# FILLED:`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from torch import Tensor

from nexrl.areal import (
    GenerationHyperparameters,
    InferenceEngine,
    LLMRequest,
    LocalToolingEnv,
    ToolExecutor,
)
from nexrl.inference.tool_parsers import get_parser

NOW = "2025-07-21 10:57:38"


# ---- seed: "The following is a simple usage example" -------------------------------------
def get_current_time() -> str:
    """The current time."""  # FILLED: the seed's `...`; a fixed time makes it checkable
    return NOW


def my_reward_fn(prompt, completion, prompt_ids, completion_ids, **kwargs):
    return len(completion_ids)


def parse_tool(resp):  # FILLED: the seed calls this helper without defining it
    _, calls, _ = get_parser("hermes").parse(resp.completion)
    return calls[0].name, calls[0].arguments


class MyRolloutWorkflow:
    def __init__(self, config: Any):
        self.config = config
        self.env = LocalToolingEnv()
        self.env.register_tool(get_current_time)

    async def arun_episode(
        self, engine: InferenceEngine, data: dict[str, Any]
    ) -> dict[str, Tensor]:
        tokenizer = engine.tokenizer  # FILLED: the seed's `tokenizer` is a global it never sets
        message = [
            # CHANGED: "content", not "message": chat templates read the `content` key
            {"role": "system", "content": "You can call tools."},
            {"role": "user", "content": data["question"]},
        ]
        turns = []
        for _ in range(self.config.num_turns):
            # CHANGED: tokenize=False (the seed's call returns ids, not the text it names)
            # and add_generation_prompt=True (else the model continues the user turn)
            text = tokenizer.apply_chat_template(
                message, tools=self.env.list_tools(), tokenize=False, add_generation_prompt=True
            )
            req = LLMRequest(text=text, gconfig=GenerationHyperparameters(greedy=True))
            resp = await engine.agenerate(req)
            tool_name, tool_args = parse_tool(resp)
            cur_time = await self.env.aexecute(tool_name, tool_args)
            message += [{"role": "user", "content": f"The current time is {cur_time}"}]
            turns.append((req, resp))
        req, resp = turns[-1]
        # CHANGED: the last turn's completion ids; the seed passes `req.input_ids`, the prompt
        reward = my_reward_fn(None, None, None, resp.output_tokens, **data)
        # FILLED: the seed's `...` before `return output`: AReaL's tensor dict of the last turn
        n_in, n_out = resp.input_len, resp.output_len
        return {
            "input_ids": torch.tensor([resp.input_tokens + resp.output_tokens]),
            "loss_mask": torch.tensor([[0] * n_in + [1] * n_out]),
            "logprobs": torch.tensor([[0.0] * n_in + resp.output_logprobs]),
            "versions": torch.tensor([[-1] * n_in + resp.output_versions]),
            "attention_mask": torch.ones(1, n_in + n_out, dtype=torch.long),
            "rewards": torch.tensor([float(reward)]),
            "messages": message,  # not a tensor: the test reads the tool results here
        }


class Config:  # the workflow config's typed attribute access (see test_seed004_config)
    num_turns = 2


def test_the_first_workflow_calls_the_tool_each_turn_and_trains_on_engine_ids(time_engine):
    workflow = MyRolloutWorkflow(Config())
    out = asyncio.run(workflow.arun_episode(time_engine, {"question": "What time is it?"}))
    tool_messages = [m["content"] for m in out["messages"][2:]]
    assert tool_messages == [f"The current time is {NOW}"] * 2
    # the reward counts the completion's ids: the scripted call is 3 tokens + EOS
    assert out["rewards"].item() == 4.0
    batch = time_engine.rollout_batch([{"question": "What time is it?"}] * 3, workflow)
    assert batch["rewards"].tolist() == [4.0, 4.0, 4.0]
    assert batch["loss_mask"].sum(-1).tolist() == [4.0, 4.0, 4.0]
    assert (batch["versions"][batch["loss_mask"] > 0] == 0).all()


# ---- seed: "RolloutWorkflow" section (ToolExecutor) ---------------------------------------
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class MyToolExecutorWorkflow:  # the seed's second `MyRolloutWorkflow`
    def __init__(self, config: Any, tokenizer: Any):
        self.config = config
        # CHANGED: ToolExecutor(tokenizer): the seed appends the result to `input_ids`, so the
        # executor must return the tool messages' token ids, which needs the tokenizer
        self.tool_executor = ToolExecutor(tokenizer)
        self.tool_executor.register_tool(add)  # the seed registers get_current_time

    async def arun_episode(
        self, engine: InferenceEngine, data: dict[str, Any]
    ) -> dict[str, Tensor]:
        req = LLMRequest(
            input_ids=data["input_ids"], gconfig=GenerationHyperparameters(greedy=True)
        )
        prompt_len, mask, logps = len(req.input_ids), [], []
        for _ in range(self.config.num_turns):
            resp = await engine.agenerate(req)
            res = await self.tool_executor.aexecute_tool(resp.completion)
            # CHANGED: the completion's own ids go in first; the seed appends only the tool's
            req.input_ids += resp.output_tokens
            req.input_ids += res
            mask += [1] * resp.output_len + [0] * len(res)
            logps += resp.output_logprobs + [0.0] * len(res)
        reward = my_reward_fn(None, None, None, req.input_ids, **data)
        # FILLED: the seed's `...` before `return output`
        ids = req.input_ids
        return {
            "input_ids": torch.tensor(ids),
            "loss_mask": torch.tensor([0] * prompt_len + mask),
            "logprobs": torch.tensor([0.0] * prompt_len + logps),
            "rewards": torch.tensor(float(reward)),
        }


def test_the_tool_executor_workflow_appends_tool_ids_between_turns(add_engine):
    tok = add_engine.tokenizer
    # CHANGED: return_dict=False (transformers 5 returns a dict by default)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "2+3?"}], add_generation_prompt=True, return_dict=False
    )
    workflow = MyToolExecutorWorkflow(Config(), tok)
    batch = add_engine.rollout_batch([{"input_ids": list(prompt)}], workflow)
    (traj,) = batch.trajectories
    text = tok.decode(traj["response_ids"])
    assert text.count("<tool_response>\n5\n</tool_response>") == 2  # the tool ran each turn
    assert traj["prompt_ids"] == list(prompt)
    # tool tokens are not trained: the two scripted replies are (3 + EOS) tokens each
    assert sum(traj["loss_mask"]) == 8
    assert batch["rewards"].item() == len(prompt) + len(traj["response_ids"])


# ---- seed: "Rule-based reward" --------------------------------------------------------------
def reward_fn(
    prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **kwargs
):
    # prompt: prompt string (the task this data needs to complete)
    # ... (the seed's comments)
    pass


def test_the_reward_signature_runs_as_written():
    assert reward_fn("p", "c", [1], [2], solutions=["x"]) is None


def test_an_llm_request_of_non_ids_is_one_clear_error(add_engine):
    import asyncio

    with pytest.raises(ValueError, match="return_dict=False"):
        asyncio.run(add_engine.agenerate(LLMRequest(input_ids=["input_ids", "attention_mask"])))
