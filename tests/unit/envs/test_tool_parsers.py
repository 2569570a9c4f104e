"""Tool-call parsers: valid calls come out, malformed or truncated ones never do."""

from __future__ import annotations

import json

import pytest

from nexrl.inference.tool_parsers import PARSERS, get_parser


def test_hermes_calls_and_content():
    text = (
        'Let me add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    )
    content, calls, failures = get_parser("hermes").parse(text)
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2}), ("now", {})]
    assert content == "Let me add." and failures == []
    entry = calls[0].to_openai()
    assert entry["type"] == "function" and json.loads(entry["function"]["arguments"]) == {
        "a": 1,
        "b": 2,
    }
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1,}</tool_call>', "invalid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "no 'name'"),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "must be an object"),
        ('<tool_call>["add"]</tool_call>', "JSON object"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1', "truncated"),
    ],
)
def test_hermes_rejects_malformed_and_truncated(text, reason):
    content, calls, failures = get_parser("qwen").parse(text)
    assert calls == []
    assert len(failures) == 1 and reason in failures[0].reason
    assert content == text  # nothing the model wrote is lost


def test_hermes_keeps_good_calls_next_to_a_bad_one():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>'
    _, calls, failures = get_parser("hermes").parse(text)
    assert [c.name for c in calls] == ["a"] and len(failures) == 1


def test_hermes_string_arguments_are_decoded():
    text = '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert get_parser("hermes").parse(text)[1][0].arguments == {"x": 1}


def test_plain_text_has_no_calls():
    for name in PARSERS:
        assert get_parser(name).parse("The answer is 4.") == ("The answer is 4.", [], [])


def test_llama3_json():
    parser = get_parser("llama3_json")
    text = '{"name": "add", "parameters": {"a": 1}}; {"name": "mul", "parameters": {"b": 2}}'
    content, calls, failures = parser.parse(text)
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1}), ("mul", {"b": 2})]
    assert content == "" and failures == []
    assert parser.parse('<|python_tag|>{"name": "x", "parameters": {}}')[1][0].name == "x"
    _, calls, failures = parser.parse('{"name": "add", "parameters": {"a": ')
    assert calls == [] and "invalid JSON" in failures[0].reason


def test_mistral():
    parser = get_parser("mistral")
    content, calls, _ = parser.parse('Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]')
    assert content == "Sure." and calls[0].arguments == {"a": 1}
    _, calls, failures = parser.parse('[TOOL_CALLS][{"name": "add", "argu')
    assert calls == [] and len(failures) == 1


def test_unknown_parser_lists_known_names():
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'; valid choices: hermes"):
        get_parser("nope")
