"""Code reward: code extraction from markdown and test parsing (no sandbox needed)."""

from __future__ import annotations

import gc
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from nexrl.rewards.code import extract_code, parse_tests, program_names


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


class _Churn:
    """A garbage cycle whose finalizer leaves another behind and yields the GIL: every
    collection, including those inside a parse, hands the interpreter to another thread."""

    active = True

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        if _Churn.active:
            _Churn()
        time.sleep(0)


def test_program_names_is_safe_on_many_threads() -> None:
    tests = [f"assert add([{i}, {i + 1}, (3, 4)], {{'a': [{i}]}}) == {i}" for i in range(50)]

    def names(_: int) -> list[str]:
        _Churn()
        return [n for _ in range(40) for n in program_names(tests, "", "add")]

    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(names, range(32)))
    finally:
        _Churn.active = False
        gc.collect()
    assert all(set(r) == {"add"} for r in results)
