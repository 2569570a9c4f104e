"""Code-execution reward: run a completion's program against unit tests in the sandbox.

Each test is its own sandboxed run (one failing or hanging test cannot take the
others down, and no state leaks between them); the reward is the fraction that
passed. Two test styles, read from the dataset row:

- stdin/stdout: `tests=[{"input": "1 2\\n", "output": "3\\n"}, ...]` (or the
  APPS/TACO shape `tests={"inputs": [...], "outputs": [...]}`): the program
  reads stdin, its stdout must equal `output` (trailing whitespace ignored).
- function call: `tests=["assert add(1, 2) == 3", ...]` (MBPP), or one
  HumanEval-style `test_code` defining `check(candidate)` plus `entry_point`.
  The test runs after the program; it passes when the process exits 0 *and*
  prints a per-run random marker after the assertion, so a program that calls
  `exit(0)` early does not pass.

Optional row keys: `test_setup` (code before the tests, MBPP's
`test_setup_code`), `code_prefix` (prepended to the extracted code, e.g. a
HumanEval prompt the completion continues).
"""

from __future__ import annotations

import re
import secrets
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from nexrl.rewards.sandbox import ExecResult, Isolation, Sandbox, SandboxLimits

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.S)


def extract_code(completion: str) -> str:
    """The last fenced block (a python-tagged one preferred), else the whole completion."""
    blocks = _FENCE.findall(completion)
    if not blocks:
        return completion
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    return (python or [body for _, body in blocks])[-1]


def _same_output(actual: str, expected: str) -> bool:
    def norm(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip().splitlines()]

    return norm(actual) == norm(expected)


def parse_tests(row: Mapping[str, Any]) -> list[dict[str, str]]:
    """The row's tests as a list of {"input", "output"} or {"assert"} dicts; clear errors."""
    if row.get("test_code"):
        if not row.get("entry_point"):
            raise ValueError("code reward: row has 'test_code' but no 'entry_point'")
        return [{"assert": f"{row['test_code']}\n\ncheck({row['entry_point']})"}]
    tests = row.get("tests")
    if isinstance(tests, Mapping) and "inputs" in tests:
        inputs, outputs = tests["inputs"], tests.get("outputs", [])
        if len(inputs) != len(outputs):
            raise ValueError(
                f"code reward: 'tests' has {len(inputs)} inputs but {len(outputs)} outputs"
            )
        tests = [{"input": i, "output": o} for i, o in zip(inputs, outputs, strict=True)]
    if not isinstance(tests, Sequence) or isinstance(tests, str) or not tests:
        raise ValueError(
            "code reward: the row needs 'tests' (a non-empty list of {'input','output'} dicts "
            f"or of assert strings) or 'test_code' + 'entry_point'; got keys {sorted(row)}"
        )
    parsed = []
    for i, test in enumerate(tests):
        if isinstance(test, str):
            parsed.append({"assert": test})
        elif isinstance(test, Mapping) and "input" in test and "output" in test:
            parsed.append({"input": str(test["input"]), "output": str(test["output"])})
        else:
            raise ValueError(
                f"code reward: tests[{i}] is neither an assert string nor input/output"
            )
    return parsed


class CodeReward:
    """The code reward bound to one sandbox; call it like any reward function."""

    def __init__(self, sandbox: Sandbox, limits: SandboxLimits | None = None) -> None:
        self.sandbox = sandbox
        self.limits = limits

    def __call__(self, prompt: str, completion: str, **row: Any) -> dict[str, Any]:
        tests = parse_tests(row)
        code = str(row.get("code_prefix") or "") + extract_code(completion)
        setup = str(row.get("test_setup") or "")
        programs = [self._program(code, setup, t) for t in tests]
        futures = [self.sandbox.submit(prog, stdin, self.limits) for prog, stdin, _ in programs]
        results = [f.result() for f in futures]
        passed = sum(
            self._passed(t, r, marker)
            for t, r, (_, _, marker) in zip(tests, results, programs, strict=True)
        )
        timeouts = sum(r.timed_out for r in results)
        return {
            "reward": passed / len(tests),
            "scores": {"tests_passed": float(passed), "tests_timed_out": float(timeouts)},
        }

    @staticmethod
    def _program(code: str, setup: str, test: dict[str, str]) -> tuple[str, str, str]:
        """(program, stdin, marker) for one test."""
        if "assert" not in test:
            return f"{setup}\n{code}", test["input"], ""
        marker = secrets.token_hex(8)
        return f"{setup}\n{code}\n\n{test['assert']}\nprint({marker!r})\n", "", marker

    @staticmethod
    def _passed(test: dict[str, str], result: ExecResult, marker: str) -> bool:
        if not result.ok:
            return False
        if marker:
            lines = result.stdout.rstrip().splitlines()
            return bool(lines) and lines[-1] == marker
        return _same_output(result.stdout, test["output"])


_default_lock = threading.Lock()
_default: CodeReward | None = None


def configure_code_reward(
    *,
    isolation: Isolation = "bwrap",
    limits: SandboxLimits | None = None,
    pool_size: int = 4,
    max_concurrency: int = 64,
) -> CodeReward:
    """(Re)build the sandbox behind the registered `code` reward; returns the reward."""
    global _default
    with _default_lock:
        if _default is not None:
            _default.sandbox.close()
        sandbox = Sandbox(
            isolation=isolation, limits=limits, pool_size=pool_size, max_concurrency=max_concurrency
        )
        _default = CodeReward(sandbox)
        return _default


def code_reward(prompt: str, completion: str, **row: Any) -> dict[str, Any]:
    """The registered `code` reward: a shared bwrap sandbox, built on first use."""
    with _default_lock:
        reward = _default
    if reward is None:
        reward = configure_code_reward()
    return reward(prompt, completion, **row)
