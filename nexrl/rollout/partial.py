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
from typing import Any

ABORT = "abort"


def split_choices(out: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per sample of a client result (shared keys + the choice's own)."""
    shared = {k: v for k, v in out.items() if k != "choices"}
    choices = [{**shared, **c} for c in out.get("choices") or [{}]]
    for c in choices:
        c.setdefault("token_versions", [])
        if not c["token_versions"]:
            c["token_versions"] = [c["model_version"]] * len(c["response_ids"])
    return choices


def aborted(choices: list[dict[str, Any]]) -> list[int]:
    """Indices of samples whose generation was cut by an abort."""
    return [i for i, c in enumerate(choices) if c.get("finish_reason") == ABORT]


def merge(prev: dict[str, Any], piece: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
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
    client: Any, choices: list[dict[str, Any]], kwargs: dict[str, Any]
) -> list[dict[str, Any]]:
    """Continue every aborted sample with one request each, concurrently; others unchanged."""
    todo = aborted(choices)
    max_tokens = int(kwargs.get("max_tokens", 64))
    out = list(choices)

    def run(i: int) -> dict[str, Any]:
        c = choices[i]
        left = max_tokens - len(c["response_ids"])
        if left <= 0:
            return {**c, "finish_reason": "length"}
        ids = list(c["prompt_ids"]) + list(c["response_ids"])
        piece = client.completion(prompt_ids=ids, **{**kwargs, "n": 1, "max_tokens": left})
        return merge(c, split_choices(piece)[0], getattr(client, "tokenizer", None))

    if len(todo) == 1:
        out[todo[0]] = run(todo[0])
        return out
    with ThreadPoolExecutor(max_workers=max(1, len(todo))) as pool:
        for i, merged in zip(todo, pool.map(run, todo), strict=True):
            out[i] = merged
    return out
