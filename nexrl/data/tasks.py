"""Built-in synthetic tasks written as train / validation JSON-lines datasets.

A task writer is a plain function `writer(dir, n_train, n_val, seed) -> (train, val)`
registered by name in `TASK_WRITERS`. Files are named by a hash of the
writer's name, version and arguments, so the same request reuses the files on
disk (cached by content) and a changed request never reads stale data. Files
are written to a temporary name and renamed, so concurrent writers are safe.

"shift_letters" was chosen by measurement (issue 2): a tiny Qwen2 learns
"shift each of 4 letters by one" to 0.9 per-position reward in about 225 GRPO
steps, while "reverse 4 letters" plateaued near 0.4 (rotary positions make
reversal hard at this size). Prompts are `"abcd>"`, answers `"bcde"`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import string
from collections.abc import Callable
from pathlib import Path

LETTERS = string.ascii_lowercase
SHIFT_MARKER = ">"

TaskWriter = Callable[..., tuple[Path, Path]]


def shift_word(word: str, shift: int = 1) -> str:
    """Shift each lowercase letter by `shift` positions, wrapping z -> a."""
    return "".join(LETTERS[(LETTERS.index(c) + shift) % 26] for c in word)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def _cached_paths(directory: str | os.PathLike, name: str, **params: object) -> tuple[Path, Path]:
    key = json.dumps({"task": name, "version": 1, **params}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{name}-{digest}-train.jsonl", d / f"{name}-{digest}-val.jsonl"


def write_shift_task(
    directory: str | os.PathLike,
    n_train: int = 4096,
    n_val: int = 64,
    seed: int = 0,
    length: int = 4,
) -> tuple[Path, Path]:
    """Write disjoint train / val sets of {"prompt": "abcd>", "answer": "bcde"} rows."""
    if n_train + n_val > 26**length:
        raise ValueError(f"n_train + n_val = {n_train + n_val} exceeds 26**{length} words")
    train_path, val_path = _cached_paths(
        directory, "shift_letters", n_train=n_train, n_val=n_val, seed=seed, length=length
    )
    if train_path.exists() and val_path.exists():
        return train_path, val_path
    codes = random.Random(seed).sample(range(26**length), n_train + n_val)  # distinct words
    rows = []
    for code in codes:
        word = "".join(LETTERS[(code // 26**i) % 26] for i in range(length))
        rows.append({"prompt": word + SHIFT_MARKER, "answer": shift_word(word)})
    _write_jsonl(train_path, rows[:n_train])
    _write_jsonl(val_path, rows[n_train:])
    return train_path, val_path


ARITHMETIC_INSTRUCTION = "Answer with the number only."


def arithmetic_row(a: int, b: int, op: str) -> dict:
    """One chat-prompt row: "What is a op b?" with the integer answer."""
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    question = f"What is {a} {op} {b}? {ARITHMETIC_INSTRUCTION}"
    return {"prompt": [{"role": "user", "content": question}], "answer": str(value)}


def write_arithmetic_task(
    directory: str | os.PathLike,
    n_train: int = 4096,
    n_val: int = 128,
    seed: int = 0,
    digits: int = 2,
    ops: str = "+-",
    operands: tuple[int, int] | None = None,
) -> tuple[Path, Path]:
    """Integer arithmetic as chat prompts (the real-model recipe, docs/models.md): operands
    of `digits` digits (or in the inclusive range `operands`), operators from `ops`; train
    and held-out validation questions are disjoint."""
    if operands is None:
        operands = (10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)
    low, high = operands
    size = high - low + 1
    space = size**2 * len(ops)
    if n_train + n_val > space:
        raise ValueError(f"n_train + n_val = {n_train + n_val} exceeds the {space} questions")
    train_path, val_path = _cached_paths(
        directory,
        "arithmetic",
        n_train=n_train,
        n_val=n_val,
        seed=seed,
        ops=ops,
        operands=(low, high),
    )
    if train_path.exists() and val_path.exists():
        return train_path, val_path
    codes = random.Random(seed).sample(range(space), n_train + n_val)  # distinct questions
    rows = []
    for code in codes:
        op, rest = ops[code % len(ops)], code // len(ops)
        rows.append(arithmetic_row(low + rest % size, low + rest // size, op))
    _write_jsonl(train_path, rows[:n_train])
    _write_jsonl(val_path, rows[n_train:])
    return train_path, val_path


def write_times_tables_task(
    directory: str | os.PathLike, n_train: int = 81, n_val: int = 40, seed: int = 0
) -> tuple[Path, Path]:
    """The real-model recipe's task: "What is a * b?" for a, b in 2..12 (121 questions, 40
    held out). Chosen by measurement: SmolLM2-135M-Instruct answers about half of them
    greedily, mostly losing the rest to rambling, and about 85% when made to answer
    directly, so there is room that RL can reach within minutes (docs/models.md)."""
    return write_arithmetic_task(
        directory, n_train=n_train, n_val=n_val, seed=seed, ops="*", operands=(2, 12)
    )


TASK_WRITERS: dict[str, TaskWriter] = {
    "shift_letters": write_shift_task,
    "arithmetic": write_arithmetic_task,
    "times_tables": write_times_tables_task,
}


def write_task(name: str, directory: str | os.PathLike, **kwargs: object) -> tuple[Path, Path]:
    """Write (or reuse) the train / val files of the task registered as `name`."""
    if name not in TASK_WRITERS:
        raise ValueError(f"unknown task {name!r}; valid choices: {', '.join(TASK_WRITERS)}")
    return TASK_WRITERS[name](directory, **kwargs)


def is_builtin_data(path: str | os.PathLike | None) -> bool:
    """Whether `path` is a built-in task's file (written by `write_task` under the cache)."""
    if path is None:
        return True
    from nexrl.models.tiny import cache_dir

    return Path(path).resolve().is_relative_to((cache_dir() / "data").resolve())


BUILTIN_MAX_TOKENS = 4  # the built-in task's answers: `rollout_worker.max_tokens`'s default


def warn_own_data_defaults(data_path: str | None, max_tokens: int) -> str | None:
    """The warning (also logged) for own data left with the built-in task's `max_tokens`,
    which cuts every completion of a real task off after 4 tokens; None: nothing to say."""
    if is_builtin_data(data_path) or max_tokens != BUILTIN_MAX_TOKENS:
        return None
    message = (
        f"rollout_worker.max_tokens={max_tokens} is the built-in task's value, but data.path "
        f"is your own data ({data_path}): completions stop after {max_tokens} tokens; set "
        "rollout_worker.max_tokens to fit your answers"
    )
    logging.getLogger("nexrl").warning(message)
    return message
