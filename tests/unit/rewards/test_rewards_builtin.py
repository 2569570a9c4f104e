"""Reward functions: hand-computed scores, registry, import path, errors propagate."""

from __future__ import annotations

import pytest

from nexrl.rewards import REWARD_FUNCTIONS, exact_match, get_reward_fn, shift_letters


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("bcde", 1.0),
        ("  bcde\n", 1.0),  # surrounding whitespace stripped
        ("bcdx", 0.75),
        ("xcdx", 0.5),
        ("bc", 0.5),  # 2 correct / max(4, 2)
        ("bcdexxxx", 0.5),  # 4 correct / max(4, 8): rambling is penalised
        ("edcb", 0.0),
        ("", 0.0),
    ],
)
def test_shift_letters_partial_credit(completion: str, score: float) -> None:
    assert shift_letters("abcd>", completion, answer="bcde", index=3) == pytest.approx(score)


def test_exact_match() -> None:
    assert exact_match("abcd>", " bcde ", answer="bcde") == 1.0
    assert exact_match("abcd>", "bcd", answer="bcde") == 0.0


def test_registry_and_import_path() -> None:
    assert get_reward_fn("shift_letters") is shift_letters
    assert get_reward_fn("nexrl.rewards:exact_match") is exact_match
    assert set(REWARD_FUNCTIONS) >= {"shift_letters", "exact_match"}
    with pytest.raises(ValueError, match="valid choices"):
        get_reward_fn("nope")
    with pytest.raises(ValueError, match="no attribute"):
        get_reward_fn("nexrl.rewards:nope")


def test_reward_errors_propagate_not_zero() -> None:
    fn = get_reward_fn("shift_letters")
    with pytest.raises(TypeError):
        fn("abcd>", "bcde")  # the row has no answer: an error, never a silent 0
