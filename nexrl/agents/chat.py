"""One chat completion with tools on an in-process engine, shaped like OpenAI's reply.

What `nexrl serve` does for `/v1/chat/completions` with `tools`, without HTTP: check the
messages, render them and the tools with the chat template, generate, parse the reply.
`LLMServiceClient.generate(messages, tools=...)` on a local engine is this call.
"""

from __future__ import annotations

from typing import Any

from nexrl.inference.api_models import assistant_message, chat_messages
from nexrl.inference.protocol import GenerationRequest, InferenceEngine, SamplingParams
from nexrl.inference.tool_parsers import ToolCallParser, get_parser


async def chat_with_tools(
    engine: InferenceEngine,
    tokenizer: Any,
    messages: list[dict[str, Any]],
    sampling: SamplingParams,
    *,
    tools: list[dict[str, Any]] | None = None,
    parser: ToolCallParser | str = "hermes",
) -> dict[str, Any]:
    """The assistant's reply: `content`, `tool_calls` (OpenAI entries, [] when none),
    `finish_reason` ("tool_calls" when it called), plus the ids for training:
    `prompt_ids`, `output_ids`, `logprobs`, `versions`, and `parse_failures` (reasons)."""
    parser = get_parser(parser) if isinstance(parser, str) else parser
    checked = chat_messages(messages)
    prompt = tokenizer.apply_chat_template(
        checked, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    resp = await engine.agenerate(GenerationRequest(list(prompt), sampling))
    out = resp.outputs[0]
    parsed = parser.parse(out.text) if tools else None
    message, finish = assistant_message(out.text, out.finish_reason, parsed)
    return {
        "content": message["content"],
        "tool_calls": message.get("tool_calls", []),
        "finish_reason": finish,
        "prompt_ids": list(resp.input_ids),
        "output_ids": out.output_ids,
        "logprobs": out.output_logprobs,
        "versions": out.output_versions,
        "parse_failures": [f.reason for f in parsed[2]] if parsed else [],
    }
