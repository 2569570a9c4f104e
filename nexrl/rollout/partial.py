"""Partial rollout: continue samples that a weight push aborted, on the new weights.

In `fully-async` mode a push aborts running requests (the engine returns what
each sample generated so far, finish_reason "abort"). With
`enable_partial_rollout` the worker keeps those tokens and sends one new
request per aborted sample: prompt = original prompt + partial response,
`max_tokens` reduced by what was generated. The pieces are concatenated
token-for-token (ids, behaviour logprobs, and the per-token weight versions
`token_versions`), so nothing is re-tokenized and the trainer sees exactly
which version sampled each token. `model_version` stays the version the
sample started on; staleness uses min(token_versions).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from nexrl.inference.protocol import CompletionResult, Decoder, SamplingKwargs

if TYPE_CHECKING:
    from nexrl.inference.client import LLMServiceClient

ABORT = "abort"


def split_choices(out: CompletionResult) -> list[CompletionResult]:
    """One dict per sample of a client result (shared keys + the choice's own)."""
    choices: list[CompletionResult] = []
    for choice in out.get("choices") or [{}]:
        c: CompletionResult = {**out, **choice}
        c.pop("choices", None)
        choices.append(c)
    for c in choices:
        c.setdefault("token_versions", [])
        if not c["token_versions"]:
            c["token_versions"] = [c["model_version"]] * len(c["response_ids"])
    return choices


def aborted(choices: list[CompletionResult]) -> list[int]:
    """Indices of samples whose generation was cut by an abort."""
    return [i for i, c in enumerate(choices) if c.get("finish_reason") == ABORT]


def merge(
    prev: CompletionResult, piece: CompletionResult, tokenizer: Decoder | None
) -> CompletionResult:
    """`prev` (aborted) followed by `piece` (its continuation) as one sample."""
    ids = list(prev["response_ids"]) + list(piece["response_ids"])
    versions = list(prev["token_versions"]) + list(
        piece.get("token_versions") or [piece["model_version"]] * len(piece["response_ids"])
    )
    text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else None
    return {
        **prev,
        "response": text if text is not None else prev["response"] + piece["response"],
        "response_ids": ids,
        "response_logprobs": list(prev["response_logprobs"]) + list(piece["response_logprobs"]),
        "token_versions": versions,
        "finish_reason": piece["finish_reason"],
        "continuations": int(prev.get("continuations", 0)) + 1,
    }


def continue_aborted(
    client: LLMServiceClient, choices: list[CompletionResult], kwargs: SamplingKwargs
) -> list[CompletionResult]:
    """Continue every aborted sample with one request each, concurrently; others unchanged."""
    todo = aborted(choices)
    max_tokens = int(kwargs.get("max_tokens", 64))
    out = list(choices)

    def run(i: int) -> CompletionResult:
        c = choices[i]
        left = max_tokens - len(c["response_ids"])
        if left <= 0:
            return {**c, "finish_reason": "length"}
        ids = list(c["prompt_ids"]) + list(c["response_ids"])
        one: SamplingKwargs = {**kwargs, "n": 1, "max_tokens": left}
        piece = client.completion(prompt_ids=ids, **one)
        return merge(c, split_choices(piece)[0], getattr(client, "tokenizer", None))

    if len(todo) == 1:
        out[todo[0]] = run(todo[0])
        return out
    with ThreadPoolExecutor(max_workers=max(1, len(todo))) as pool:
        for i, merged in zip(todo, pool.map(run, todo), strict=True):
            out[i] = merged
    return out
