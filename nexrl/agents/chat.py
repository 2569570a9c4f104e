"""One chat completion with tools on an in-process engine, shaped like OpenAI's reply.

What `nexrl serve` does for `/v1/chat/completions` with `tools`, without HTTP: check the
messages, render them and the tools with the chat template, generate, parse the reply.
`LLMServiceClient.generate(messages, tools=...)` on a local engine is this call.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from nexrl.inference.api_models import assistant_message, chat_messages
from nexrl.inference.protocol import GenerationRequest, InferenceEngine, SamplingParams
from nexrl.inference.tool_parsers import ToolCallParser, get_parser

logger = logging.getLogger(__name__)


class ChatReply(TypedDict):
    """`chat_with_tools`' answer: the OpenAI reply fields and the ids for training."""

    content: str | None
    tool_calls: list[dict[str, object]]
    finish_reason: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    parse_failures: list[str]


async def chat_with_tools(
    engine: InferenceEngine,
    tokenizer: Any,
    messages: Sequence[Mapping[str, object]],
    sampling: SamplingParams,
    *,
    tools: Sequence[Mapping[str, object]] | None = None,
    parser: ToolCallParser | str = "hermes",
) -> ChatReply:
    """The assistant's reply: `content`, `tool_calls` (OpenAI entries, [] when none),
    `finish_reason` ("tool_calls" when it called), plus the ids for training:
    `prompt_ids`, `output_ids`, `logprobs`, `versions`, and `parse_failures` (reasons)."""
    parser = get_parser(parser) if isinstance(parser, str) else parser
    checked = chat_messages(messages)
    warn_if_template_drops(tokenizer, checked, tools)
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


# tokenizer -> the kinds already checked (weak: an id could be reused by a new tokenizer)
_TEMPLATE_CHECKED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def warn_if_template_drops(
    tokenizer: Any,
    messages: Sequence[Mapping[str, object]],
    tools: Sequence[Mapping[str, object]] | None,
) -> list[str]:
    """Warn (once per tokenizer and kind) when the chat template renders `tools`, or the
    assistant `tool_calls` of `messages`, to nothing: the model then never sees the tool
    schemas or its own calls (SmolLM2's template has no place for either). Returns the
    warnings made now. Called by the server, the proxy and the token tracker."""
    made = []
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    checks = []
    if tools:
        checks.append(("tools", messages, {"tools": None}, "the `tools` schemas"))
    if any(m.get("role") == "assistant" and m.get("tool_calls") for m in messages):
        bare = [
            {k: v for k, v in m.items() if k != "tool_calls"} if m.get("role") == "assistant" else m
            for m in messages
        ]
        checks.append(("tool_calls", bare, {}, "assistant `tool_calls`"))
    checked = _TEMPLATE_CHECKED.setdefault(tokenizer, set())
    for kind, other, override, what in checks:
        if kind in checked:
            continue
        checked.add(kind)
        with_it = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False)
        kwargs = {"tools": tools or None, **override}
        without = tokenizer.apply_chat_template(other, tokenize=False, **kwargs)
        if with_it == without:
            message = (
                f"the chat template of {name} renders {what} to nothing: the model never sees "
                "them; use a model whose template supports tools (or write the tools into "
                "the system prompt)"
            )
            logger.warning(message)
            made.append(message)
    return made
