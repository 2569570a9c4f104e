"""Workflows the agent tests run inside the pipeline (imported by config path)."""

from __future__ import annotations

from typing import Any

from nexrl.agents.workflows import ToolWorkflow
from nexrl.inference.protocol import GenerationRequest, SamplingParams
from nexrl.rollout.workflow import RolloutWorkflow

SEEN: list[dict[str, Any]] = []  # every trajectory built in this process (test inspection)


class TwoTurnWorkflow(RolloutWorkflow):
    """Two assistant turns with a user nudge between them, built token-exact by appending:
    the engine's ids for assistant turns (loss_mask 1), the tokenizer's ids for the nudge
    (loss_mask 0). The second turn's text is the answer the reward scores."""

    def __init__(self, config: Any = None, nudge: str = "\nTry again:") -> None:
        self.max_tokens = getattr(config, "max_tokens", 4)
        self.temperature = getattr(config, "temperature", 1.0)
        self.nudge = nudge

    async def arun_episode(self, engine, data):
        tok = engine.tokenizer
        prompt = list(tok(data["prompt"], add_special_tokens=True)["input_ids"])
        sampling = SamplingParams(self.max_tokens, self.temperature)
        ids, mask, logps, versions = [], [], [], []
        text = ""
        for turn in range(2):
            if turn:
                nudge = list(tok(self.nudge, add_special_tokens=False)["input_ids"])
                ids += nudge
                mask += [0] * len(nudge)
                logps += [0.0] * len(nudge)
                versions += [-1] * len(nudge)
            resp = await engine.agenerate(GenerationRequest(prompt + ids, sampling))
            out = resp.outputs[0]
            ids += out.output_ids
            mask += [1] * len(out.output_ids)
            logps += out.output_logprobs
            versions += out.output_versions
            text = out.text
        traj = {
            "prompt_ids": prompt,
            "response_ids": ids,
            "response_logprobs": logps,
            "loss_mask": mask,
            "token_versions": versions,
            "model_version": min(v for v, m in zip(versions, mask, strict=True) if m),
            "finish_reason": out.finish_reason,
            "response": text,
        }
        SEEN.append(traj)
        return traj


class RejectAll(RolloutWorkflow):
    async def arun_episode(self, engine, data):
        return None


def sdk_agent(base_url: str, api_key: str, data: dict[str, Any]) -> float:
    """An agent written against the openai SDK (one completion); rewards even lengths."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": data["prompt"]}], max_tokens=4
    )
    return float(len(reply.choices[0].message.content or "") % 2 == 0)


class RecordingToolWorkflow(ToolWorkflow):
    """The built-in ToolWorkflow, keeping what it returns in SEEN."""

    async def arun_episode(self, engine, data):
        out = await super().arun_episode(engine, data)
        SEEN.extend(out)
        return out
