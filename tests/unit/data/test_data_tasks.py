"""Built-in task writer: content, disjointness, caching, and the tiny model's vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nexrl.data import HFDataLoader, shift_word, write_shift_task, write_task
from nexrl.models.tiny import CHARS


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_shift_word_hand_values() -> None:
    assert shift_word("abcd") == "bcde"
    assert shift_word("xyza") == "yzab"
    assert shift_word("zzzz") == "aaaa"


def test_write_shift_task_rows_disjoint_and_correct(tmp_path: Path) -> None:
    train, val = write_shift_task(tmp_path, n_train=300, n_val=40, seed=1)
    tr, va = read(train), read(val)
    assert len(tr) == 300 and len(va) == 40
    prompts = [r["prompt"] for r in tr + va]
    assert len(set(prompts)) == 340  # distinct, hence train and val are disjoint
    for row in tr + va:
        word, marker = row["prompt"][:4], row["prompt"][4:]
        assert marker == ">" and word.isalpha() and word.islower()
        assert row["answer"] == shift_word(word)
        assert set(row["prompt"] + row["answer"]) <= set(CHARS)  # tokenizable one char per token
    assert HFDataLoader({"path": str(train)}).num_rows == 300


def test_write_shift_task_is_cached_by_content(tmp_path: Path) -> None:
    train, val = write_shift_task(tmp_path, n_train=50, n_val=10, seed=0)
    stamp = train.stat().st_mtime_ns
    assert write_task("shift_letters", tmp_path, n_train=50, n_val=10, seed=0) == (train, val)
    assert train.stat().st_mtime_ns == stamp  # reused, not rewritten
    other, _ = write_shift_task(tmp_path, n_train=50, n_val=10, seed=1)
    assert other != train and read(other) != read(train)
    with pytest.raises(ValueError, match="valid choices"):
        write_task("reverse", tmp_path)
