"""Code reward: code extraction from markdown and test parsing (no sandbox needed)."""

from __future__ import annotations

import pytest

from nexrl.rewards.code import extract_code, parse_tests


def test_extract_code_prefers_the_last_python_block() -> None:
    text = "Plan:\n```text\nnot code\n```\n```python\nx = 1\n```\nthen\n```py\nx = 2\n```\n"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("print(4)") == "print(4)"  # no fence: the completion is the code


def test_parse_tests_shapes() -> None:
    io = parse_tests({"tests": [{"input": "1\n", "output": "2\n"}]})
    assert io == [{"input": "1\n", "output": "2\n"}]
    apps = parse_tests({"tests": {"inputs": ["1", "2"], "outputs": ["a", "b"]}})
    assert [t["output"] for t in apps] == ["a", "b"]
    assert parse_tests({"tests": ["assert f(1) == 2"]}) == [{"assert": "assert f(1) == 2"}]
    humaneval = parse_tests({"test_code": "def check(c):\n    assert c(1)", "entry_point": "f"})
    assert humaneval[0]["assert"].endswith("check(f)")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({}, "needs 'tests'"),
        ({"tests": []}, "needs 'tests'"),
        ({"tests": [3]}, r"tests\[0\]"),
        ({"tests": {"inputs": ["1"], "outputs": []}}, "1 inputs but 0 outputs"),
        ({"test_code": "def check(c): pass"}, "entry_point"),
    ],
)
def test_parse_tests_errors_name_the_problem(row, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_tests(row)
