"""Token-exact multi-turn trajectories.

A multi-turn episode is trained on the exact ids the engine sampled: nothing
the policy generated is ever re-tokenized (re-tokenizing drifts: BPE merges
differ across turn boundaries, and chat-template boundary tokens get lost when
ids are concatenated by hand). `MultiTurnTokens` builds the trajectory only by
appending

- the engine's ids for assistant turns (`loss_mask` 1, their logprobs and
  weight versions), and
- the template's ids for everything else (the prompt, tool and user
  messages, the end-of-turn tokens the template puts after an assistant turn,
  the next generation prompt), `loss_mask` 0.

The environment's ids are the part of `apply_chat_template(history + new,
add_generation_prompt=True)` after the ids accumulated so far. That is the
difference between the renderings of `messages[:k+1]` and `messages[:k]`,
taken against what was really accumulated, so the tokens a template writes
after an assistant's end-of-turn token (ChatML's `\\n` after `<|im_end|>`)
are not lost. A strict prefix check runs on every turn: the rendering of the
history must start with the ids so far. Template ids must match exactly; an
assistant turn must match by its ids or, when the engine sampled a tokenization
of its text that is not the tokenizer's own (sampling does that: a real model
writes `"}` + `}` where the tokenizer would write `"` + `}}`), by its text.
The sample keeps the engine's ids either way (they are what the policy sampled
and what the next turn is generated from); such turns are counted
(`agent/retokenized_turns`). A special token the engine sampled last in a turn
(EOS) that the template does not render is kept (the policy must learn to
stop) and skipped by the check. When the check fails, the template rewrote
history (thinking templates drop earlier reasoning): with `on_rewrite="error"`
that is a `TemplateMismatchError` naming the turn and the first differing
token; with `on_rewrite="split"` the current sample ends and a new one starts
from the template's rendering (each sample trains its own turns, token-exact).

Pass assistant messages to the history as the raw decoded text (the
default): a template that re-renders parsed `tool_calls` in its own JSON
format would not reproduce the model's ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from nexrl.agents.chat import warn_if_template_drops


class TemplateMismatchError(ValueError):
    """The chat template's rendering of the history does not extend the ids so far."""


@dataclass
class TokenSample:
    """One training sample: `loss_mask[i]` is 1 where the policy sampled `input_ids[i]`.

    `logprobs[i]` is the engine's logprob of a policy token (0.0 elsewhere);
    `versions[i]` is the weight version that sampled it (-1 elsewhere).
    """

    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    ghosts: set[int] = field(default_factory=set, repr=False)  # see the module docstring

    def extend(
        self, ids: list[int], mask: int, logprobs: list[float] | None, versions: list[int] | None
    ) -> None:
        self.input_ids += ids
        self.loss_mask += [mask] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.versions += list(versions) if versions is not None else [-1] * len(ids)

    @property
    def prompt_len(self) -> int:
        """Tokens before the first policy token (the whole sample when there is none)."""
        return next((i for i, m in enumerate(self.loss_mask) if m), len(self.loss_mask))


def _spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal `mask` values: (start, end, value)."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


class _Matcher:
    """Matches accumulated ids against a rendering of the history (see the module docstring):
    template ids exactly, policy turns by their ids or, failing that, by their text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.retokenized = 0  # policy turns matched by text only, in the last `match`

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def match(self, sample: TokenSample, rendered: list[int]) -> tuple[int, int]:
        """(acc index, rendered index) where they first differ, or (len(acc), j) when all
        of the accumulated ids matched up to `rendered[j]`."""
        acc, j = sample.input_ids, 0
        self.retokenized = 0
        for start, end, policy in _spans(sample.loss_mask):
            if not policy:
                for i in range(start, end):
                    if j >= len(rendered) or rendered[j] != acc[i]:
                        return i, j
                    j += 1
                continue
            k = self._policy_turn(acc[start:end], start, sample.ghosts, rendered, j)
            if k is None:
                return start + _common_prefix(acc[start:end], rendered[j:]), j
            j = k
        return len(acc), j

    def _policy_turn(
        self, ids: list[int], offset: int, ghosts: set[int], rendered: list[int], j: int
    ) -> int | None:
        kept = [t for i, t in enumerate(ids, offset) if i not in ghosts]
        for turn in (ids, kept) if kept != ids else (ids,):
            if rendered[j : j + len(turn)] == turn:
                return j + len(turn)
        for turn in (ids, kept) if kept != ids else (ids,):
            k = self._by_text(self.text(turn), rendered, j)
            if k is not None:
                self.retokenized += 1
                return k
        return None

    def _by_text(self, text: str, rendered: list[int], j: int) -> int | None:
        """The end k of the shortest `rendered[j:k]` whose text is `text`, if there is one."""
        for k in range(j + 1, len(rendered) + 1):
            piece = self.text(rendered[j:k])
            if piece == text:
                return k
            if len(piece) > len(text) or not text.startswith(piece.rstrip("\ufffd")):
                return None
        return None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class MultiTurnTokens:
    """Accumulates one episode's ids turn by turn (see the module docstring).

    tokenizer: a HF tokenizer with a chat template.
    messages: the opening messages (system, user).
    tools: OpenAI tool schemas, rendered by the template (`apply_chat_template(tools=...)`).
    on_rewrite: "error" raises `TemplateMismatchError` when the prefix check fails; "split"
        starts a new sample instead.
    template_kwargs: extra keyword arguments of `apply_chat_template` (e.g. enable_thinking).
    """

    def __init__(
        self,
        tokenizer: Any,
        messages: Sequence[Mapping[str, object]],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        on_rewrite: Literal["error", "split"] = "error",
        template_kwargs: Mapping[str, object] | None = None,
    ) -> None:
        if on_rewrite not in ("error", "split"):
            raise ValueError(f"on_rewrite must be 'error' or 'split', got {on_rewrite!r}")
        self.tokenizer, self.tools, self.on_rewrite = tokenizer, tools, on_rewrite
        self.template_kwargs = dict(template_kwargs or {})
        self.messages: list[Mapping[str, object]] = list(messages)
        self.turns = 0
        self._special = set(getattr(tokenizer, "all_special_ids", []))
        self._matcher = _Matcher(tokenizer)
        self.retokenized_turns = 0
        self._samples = [TokenSample()]
        self._samples[0].extend(self.render(self.messages), 0, None, None)

    # -- the engine's side ---------------------------------------------------------------
    def prompt_ids(self) -> list[int]:
        """The ids to generate the next assistant turn from (the current sample so far)."""
        return list(self._samples[-1].input_ids)

    def add_assistant(
        self,
        output_ids: list[int],
        logprobs: list[float],
        versions: list[int] | None = None,
        message: Mapping[str, object] | None = None,
    ) -> Mapping[str, object]:
        """Append one sampled turn (its ids exactly); returns the history message added.

        `message` defaults to the decoded text as the assistant's content.
        """
        if len(logprobs) != len(output_ids):
            raise ValueError(f"{len(output_ids)} output ids but {len(logprobs)} logprobs")
        if versions is not None and len(versions) != len(output_ids):
            raise ValueError(f"{len(output_ids)} output ids but {len(versions)} versions")
        sample = self._samples[-1]
        if output_ids and output_ids[-1] in self._special:
            sample.ghosts.add(len(sample.input_ids) + len(output_ids) - 1)
        sample.extend(list(output_ids), 1, logprobs, versions)
        if message is None:
            text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
            message = {"role": "assistant", "content": text}
        self.messages.append(message)
        self.turns += 1
        return message

    # -- the environment's side ----------------------------------------------------------
    def add_messages(self, messages: Sequence[Mapping[str, object]]) -> list[int]:
        """Append environment messages (tool results, user turns) and the next generation
        prompt, as the template renders them; returns the ids added (loss_mask 0)."""
        history = self.messages + list(messages)
        rendered = self.render(history)
        sample = self._samples[-1]
        i, j = self._matcher.match(sample, rendered)
        self.retokenized_turns = max(self.retokenized_turns, self._matcher.retokenized)
        if i < len(sample.input_ids):
            if self.on_rewrite == "error":
                raise TemplateMismatchError(self._explain(sample.input_ids, rendered, i, j))
            self._samples.append(TokenSample())
            self._samples[-1].extend(rendered, 0, None, None)
            self.messages = history
            return rendered
        added = rendered[j:]
        sample.extend(added, 0, None, None)
        self.messages = history
        return added

    def render(self, messages: Sequence[Mapping[str, object]]) -> list[int]:
        """The template's ids for `messages` followed by the assistant generation prompt."""
        warn_if_template_drops(self.tokenizer, messages, self.tools)
        ids = self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            add_generation_prompt=True,
            tokenize=True,
            **self.template_kwargs,
            return_dict=False,
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def _explain(self, acc: list[int], rendered: list[int], i: int, j: int) -> str:
        def show(ids: list[int]) -> str:
            return repr(self.tokenizer.decode(ids))

        return (
            f"turn {self.turns}: the chat template renders the history differently from the ids "
            f"accumulated so far, at token {i} (so far: ...{show(acc[max(0, i - 12) : i + 1])}, "
            f"template: ...{show(rendered[max(0, j - 12) : j + 1])}). The template rewrites "
            "earlier turns (e.g. drops reasoning) or an assistant message's text is not the "
            "text of its ids; pass on_rewrite='split' to start a new sample instead."
        )

    # -- results ---------------------------------------------------------------------------
    def samples(self) -> list[TokenSample]:
        """The episode's samples: one, or one per history rewrite with on_rewrite='split'."""
        return list(self._samples)

    def metrics(self) -> dict[str, float]:
        masked = sum(m == 0 for s in self._samples for m in s.loss_mask)
        policy = sum(m == 1 for s in self._samples for m in s.loss_mask)
        return {
            "agent/turns": self.turns,
            "agent/samples": len(self._samples),
            "agent/policy_tokens": policy,
            "agent/masked_tokens": masked,
            "agent/retokenized_turns": self.retokenized_turns,
        }
