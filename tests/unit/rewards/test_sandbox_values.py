"""The plain-value encoding between a program and the grader, and the names the grader stubs."""

from __future__ import annotations

import math

import pytest

from nexrl.rewards.code import program_names
from nexrl.rewards.sandbox_inside import decode, encode


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -(10**400),
        1.5,
        float("inf"),
        "s",
        b"\x00b",
        1 + 2j,
        [1, (2, 3)],
        {"a": {1, 2}, (1, 2): frozenset({3})},
        [[[]]],
    ],
)
def test_plain_values_round_trip_with_their_exact_types(value) -> None:
    back = decode(encode(value))
    assert back == value and type(back) is type(value)


def test_nan_round_trips() -> None:
    assert math.isnan(decode(encode(float("nan"))))


class Yes:
    def __eq__(self, other: object) -> bool:
        return True


class Int(int):
    def __eq__(self, other: object) -> bool:
        return True


@pytest.mark.parametrize("value", [Yes(), Int(3), [Int(1)], {"k": Yes()}, print, iter([])])
def test_anything_but_exact_builtin_types_is_refused(value) -> None:
    with pytest.raises(TypeError, match="not a plain builtin value"):
        encode(value)


@pytest.mark.parametrize(
    "forged",
    [{"list": [1], "x": 2}, {"eq": 1}, {"float": 3}, [1], {"set": [[1]]}, {"dict": [[[1], 2]]}],
)
def test_decoding_a_forged_tree_raises(forged) -> None:
    with pytest.raises(TypeError):
        decode(forged)


def test_only_the_programs_names_are_stubbed() -> None:
    tests = ["assert abs(f(1) - 2) < 1e-9", "x = g(2)\nassert x == helper(3) and math.pi"]
    setup = "import math\ndef helper(v):\n    return v"
    assert program_names(tests, setup) == ["f", "g"]
    humaneval = "def check(candidate):\n    assert candidate(1) == poly([1], 2)"
    assert program_names([humaneval + "\ncheck(sq)"], "", "sq") == ["poly", "sq"]
    with pytest.raises(ValueError, match=r"tests\[0\] is not valid Python"):
        program_names(["assert f(("], "")
