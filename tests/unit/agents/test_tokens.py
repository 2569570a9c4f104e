"""Token-exact multi-turn trajectories on the tiny model's template and ChatML (SmolLM2)."""

from __future__ import annotations

import pytest

from nexrl.agents import MultiTurnTokens, TemplateMismatchError
from nexrl.models.tiny import build_char_tokenizer
from tests.unit.agents.chatml import (
    SMOLLM2_TEMPLATE,
    THINKING_TEMPLATE,
    TOOLS_TEMPLATE,
    build_chatml_tokenizer,
)


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def chatml_tok():
    return build_chatml_tokenizer(SMOLLM2_TEMPLATE)


def _engine_turn(tok, text: str) -> list[int]:
    """What an engine returns: the text's ids and the EOS it stopped on."""
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def _episode(tok, replies, env_msgs, **kw):
    traj = MultiTurnTokens(tok, [{"role": "user", "content": "what is 2+3?"}], **kw)
    for k, reply in enumerate(replies):
        ids = _engine_turn(tok, reply)
        traj.add_assistant(ids, [-0.5] * len(ids), [7] * len(ids))
        if k < len(env_msgs):
            traj.add_messages(env_msgs[k])
    return traj


TOOL_MSG = [{"role": "tool", "content": "5"}]


@pytest.mark.parametrize("tok_name", ["tiny_tok", "chatml_tok"])
def test_whole_equals_template_rendering(tok_name, request):
    tok = request.getfixturevalue(tok_name)
    replies = ["call add 2 3", "the answer is 5"]
    traj = _episode(tok, replies, [TOOL_MSG])
    (sample,) = traj.samples()
    msgs = [
        {"role": "user", "content": "what is 2+3?"},
        {"role": "assistant", "content": replies[0]},
        *TOOL_MSG,
        {"role": "assistant", "content": replies[1]},
    ]
    rendered = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    # Equal to the template's rendering, up to an EOS the template does not write.
    kept = [t for i, t in enumerate(sample.input_ids) if i not in sample.ghosts or t in rendered]
    assert kept == list(rendered)[: len(kept)]
    policy = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    assert policy == _engine_turn(tok, replies[0]) + _engine_turn(tok, replies[1])
    assert all(lp == -0.5 for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True) if m)
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True) if not m)
    assert {v for v, m in zip(sample.versions, sample.loss_mask, strict=True) if not m} == {-1}
    assert len(sample.input_ids) == len(sample.logprobs) == len(sample.versions)
    metrics = traj.metrics()
    assert metrics["agent/turns"] == 2 and metrics["agent/policy_tokens"] == len(policy)


def test_chatml_boundary_tokens_are_kept(chatml_tok):
    """The `\\n` ChatML writes after <|im_end|> is in the trajectory, masked (verl #3720)."""
    tok = chatml_tok
    traj = _episode(tok, ["hi"], [TOOL_MSG])
    sample = traj.samples()[0]
    end = len(sample.input_ids) - 1 - sample.loss_mask[::-1].index(1)  # last policy token
    assert sample.input_ids[end] == tok.convert_tokens_to_ids("<|im_end|>")
    added = tok.decode(sample.input_ids[end + 1 :])
    assert added == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert traj.prompt_ids() == sample.input_ids


def test_tiny_template_keeps_eos_it_does_not_render(tiny_tok):
    traj = _episode(tiny_tok, ["abc"], [TOOL_MSG])
    sample = traj.samples()[0]
    text = tiny_tok.decode(sample.input_ids)
    assert text.startswith("<s>user: what is 2+3?\nassistant: abc</s>\ntool: 5\nassistant: ")


def test_truncated_turn_gets_the_template_end_tokens(chatml_tok):
    tok = chatml_tok
    traj = MultiTurnTokens(tok, [{"role": "user", "content": "q"}])
    ids = tok("cut sho", add_special_tokens=False)["input_ids"]  # stopped by max_tokens
    traj.add_assistant(ids, [0.0] * len(ids))
    added = traj.add_messages(TOOL_MSG)
    assert tok.decode(added).startswith("<|im_end|>\n<|im_start|>tool")


def test_tools_are_rendered(chatml_tok):
    tok = build_chatml_tokenizer(TOOLS_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    traj = MultiTurnTokens(tok, [{"role": "user", "content": "q"}], tools=tools)
    assert '"name": "add"' in tok.decode(traj.prompt_ids())


def test_engine_tokenization_of_the_same_text_is_kept(chatml_tok):
    """Engine ids that are not the tokenizer's own tokenization of their text (sampling does
    that) pass the check by their text; the sample keeps the engine's ids, and the turn is
    counted."""
    tok = chatml_tok
    traj = MultiTurnTokens(tok, [{"role": "user", "content": "q"}])
    canonical = tok("the answer", add_special_tokens=False)["input_ids"]
    pieces = tok.convert_ids_to_tokens(canonical)
    k = next(i for i, p in enumerate(pieces) if len(p) > 1)
    by_bytes = [tok.convert_tokens_to_ids(c) for c in pieces[k]]
    ids = canonical[:k] + by_bytes + canonical[k + 1 :] + [tok.eos_token_id]  # same text
    assert tok.decode(ids) == tok.decode(canonical + [tok.eos_token_id])
    assert ids != canonical + [tok.eos_token_id]
    start = len(traj.prompt_ids())
    traj.add_assistant(ids, [0.0] * len(ids))
    added = traj.add_messages(TOOL_MSG)
    (sample,) = traj.samples()
    assert sample.input_ids[start : start + len(ids)] == ids and sample.loss_mask[start] == 1
    assert tok.decode(sample.input_ids) == tok.decode(traj.render(traj.messages))
    assert added and traj.metrics()["agent/retokenized_turns"] == 1
    traj.add_assistant(canonical + [tok.eos_token_id], [0.0] * (len(canonical) + 1))
    traj.add_messages(TOOL_MSG)  # the earlier turn is still matched by its text
    assert traj.metrics()["agent/samples"] == 1


def test_other_text_is_a_clear_error(chatml_tok):
    """An assistant message whose text is not the text of its ids fails the check."""
    tok = chatml_tok
    traj = MultiTurnTokens(tok, [{"role": "user", "content": "q"}])
    ids = tok("the answer", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    traj.add_assistant(ids, [0.0] * len(ids), message={"role": "assistant", "content": "other"})
    with pytest.raises(TemplateMismatchError, match="turn 1: .* at token"):
        traj.add_messages(TOOL_MSG)


def test_history_rewrite_errors_or_splits():
    tok = build_chatml_tokenizer(THINKING_TEMPLATE)
    replies = ["<think>hmm</think>call", "<think>so</think>5"]
    with pytest.raises(TemplateMismatchError, match="rewrites earlier turns"):
        _episode(tok, replies, [TOOL_MSG])
    traj = _episode(tok, replies, [TOOL_MSG], on_rewrite="split")
    first, second = traj.samples()
    assert tok.decode([t for t, m in zip(first.input_ids, first.loss_mask, strict=True) if m]) == (
        "<think>hmm</think>call<|im_end|>"
    )
    text = tok.decode(second.input_ids)
    assert "hmm" not in text and text.endswith("<think>so</think>5<|im_end|>")
    assert second.loss_mask[second.prompt_len :].count(0) == 0
    assert traj.metrics()["agent/samples"] == 2


def test_bad_arguments(chatml_tok):
    with pytest.raises(ValueError, match="on_rewrite"):
        MultiTurnTokens(chatml_tok, [], on_rewrite="ignore")
    traj = MultiTurnTokens(chatml_tok, [{"role": "user", "content": "q"}])
    with pytest.raises(ValueError, match="2 output ids but 1 logprobs"):
        traj.add_assistant([1, 2], [0.0])


def test_a_template_that_drops_tools_and_tool_calls_is_warned_once_each(caplog):
    import logging

    from nexrl.agents.chat import warn_if_template_drops
    from tests.unit.agents.chatml import TOOLS_TEMPLATE, build_chatml_tokenizer

    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    smol = build_chatml_tokenizer()  # SmolLM2's template: no place for tools nor calls
    with caplog.at_level(logging.WARNING):
        made = warn_if_template_drops(smol, messages, tools)
        assert [m.split(" renders ")[1].split(" to ")[0] for m in made] == [
            "the `tools` schemas",
            "assistant `tool_calls`",
        ]
        assert warn_if_template_drops(smol, messages, tools) == []  # once per tokenizer
        assert warn_if_template_drops(build_chatml_tokenizer(TOOLS_TEMPLATE), messages, tools) == []


def test_the_server_and_the_client_warn_when_the_template_drops_tools(caplog):
    import logging

    from nexrl.inference.server import _render
    from tests.unit.agents.chatml import build_chatml_tokenizer

    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    messages = [{"role": "user", "content": "2+3?"}]
    smol = build_chatml_tokenizer()  # a fresh tokenizer: not yet checked
    with caplog.at_level(logging.WARNING):
        ids = _render(smol, messages, tools)
    assert ids and any("the `tools` schemas" in r.getMessage() for r in caplog.records)
