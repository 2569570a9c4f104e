"""Code-execution reward: run a completion's program against unit tests in the sandbox.

Each test runs against its own program process (one failing or hanging test
cannot take the others down, and no state passes between them); up to
`MAX_CASES` tests share one sandbox job. The reward is the fraction that
passed. Two test styles, read from the dataset row:

- stdin/stdout: `tests=[{"input": "1 2\\n", "output": "3\\n"}, ...]` (or the
  APPS/TACO shape `tests={"inputs": [...], "outputs": [...]}`): the program
  reads stdin, its stdout must equal `output` (trailing whitespace ignored).
  Expected outputs never enter the sandbox; the host compares.
- function call: `tests=["assert add(1, 2) == 3", ...]` (MBPP), or one
  HumanEval-style `test_code` defining `check(candidate)` plus `entry_point`.
  The test code runs in a checker process of the sandbox, not in the program's: the
  program's functions are reached through stubs whose results come back as
  plain builtin values (`sandbox_inside.encode`), so an object whose `__eq__`
  always says yes cannot be returned, and tracing hooks, patched builtins or
  introspection in the program cannot touch the test code or see its
  expected values. A test passes when its code runs without raising.

Optional row keys: `test_setup` (code before the program and before the tests,
MBPP's `test_setup_code`), `code_prefix` (prepended to the extracted code,
e.g. a HumanEval prompt the completion continues).
"""

from __future__ import annotations

import ast
import builtins
import re
import threading
from collections.abc import Mapping, Sequence

from nexrl.rewards.calls import RewardDict
from nexrl.rewards.sandbox import (
    MAX_CASES,
    CallResult,
    ExecResult,
    Isolation,
    Sandbox,
    SandboxLimits,
)
from nexrl.rewards.sandbox_forkserver import ForkServerSandbox

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


def parse_tests(row: Mapping[str, object]) -> list[dict[str, str]]:
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


# CPython 3.11 keeps the AST builder's recursion depth in one counter per interpreter, so
# two threads parsing at once (a finalizer run by the GC mid-parse lets the other thread in)
# can fail with "SystemError: AST constructor recursion depth mismatch" (CPython issue 106905).
# Rewards are scored on many threads; parsing takes microseconds, so parses take turns.
_PARSE_LOCK = threading.Lock()


def _parse(src: str) -> ast.AST:
    with _PARSE_LOCK:
        return ast.parse(src)


def program_names(tests: Sequence[str], setup: str, entry_point: str | None = None) -> list[str]:
    """Names the tests call that neither Python nor the tests nor the setup define: the
    program's functions, which the grader reaches through stubs (never its own builtins)."""
    loaded: set[str] = set()
    bound: set[str] = set()
    for i, src in enumerate([setup, *tests]):
        try:
            tree = _parse(src)
        except SyntaxError as exc:
            where = "test_setup" if i == 0 else f"tests[{i - 1}]"
            raise ValueError(f"code reward: {where} is not valid Python: {exc}") from None
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                (loaded if isinstance(node.ctx, ast.Load) and i else bound).add(node.id)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                bound.add(node.name)
            elif isinstance(node, ast.arg):
                bound.add(node.arg)
            elif isinstance(node, ast.alias):
                bound.add((node.asname or node.name).split(".")[0])
    names = loaded - bound - set(dir(builtins))
    return sorted(names | ({entry_point} if entry_point else set()))


class CodeReward:
    """The code reward bound to one sandbox; call it like any reward function."""

    def __init__(self, sandbox: Sandbox, limits: SandboxLimits | None = None) -> None:
        self.sandbox = sandbox
        self.limits = limits

    def __call__(self, prompt: str, completion: str, **row: object) -> RewardDict:
        tests = parse_tests(row)
        code = str(row.get("code_prefix") or "") + extract_code(completion)
        setup = str(row.get("test_setup") or "")
        io = [t for t in tests if "assert" not in t]
        calls = [t["assert"] for t in tests if "assert" in t]
        entry = row.get("entry_point")
        entry_point = None if entry is None else str(entry)
        names = program_names(calls, setup, entry_point) if calls else []
        box = self.sandbox
        case_futures = [
            box.submit_fn(
                box.run_cases, setup + "\n" + code, [t["input"] for t in chunk], self.limits
            )
            for chunk in _chunks(io)
        ]
        call_futures = [
            box.submit_fn(box.run_calls, code, chunk, names, setup, self.limits)
            for chunk in _chunks(calls)
        ]
        cases = [r for f in case_futures for r in f.result()]
        checks = [r for f in call_futures for r in f.result()]
        passed = sum(
            r.ok and _same_output(r.stdout, t["output"]) for t, r in zip(io, cases, strict=True)
        )
        passed += sum(r.passed for r in checks)
        results: list[ExecResult | CallResult] = [*cases, *checks]
        return {
            "reward": passed / len(tests),
            "scores": {
                "tests_passed": float(passed),
                "tests_timed_out": float(sum(r.timed_out for r in results)),
                "sandbox_errors": float(sum(r.error is not None for r in results)),
            },
        }


def _chunks(items: list) -> list[list]:
    return [items[i : i + MAX_CASES] for i in range(0, len(items), MAX_CASES)]


_default_lock = threading.Lock()
_default: CodeReward | None = None


def configure_code_reward(
    *,
    isolation: Isolation = "bwrap",
    limits: SandboxLimits | None = None,
    pool_size: int = 4,
    max_concurrency: int = 64,
    fork_server: bool = True,
) -> CodeReward:
    """(Re)build the sandbox behind the registered `code` reward; returns the reward.

    `fork_server` (bwrap only): a `ForkServerSandbox` (each sandbox serves many
    jobs, about 5x the throughput) rather than one fresh sandbox per job.
    """
    global _default
    with _default_lock:
        if _default is not None:
            _default.sandbox.close()
        kind = ForkServerSandbox if fork_server and isolation == "bwrap" else Sandbox
        sandbox = kind(
            isolation=isolation, limits=limits, pool_size=pool_size, max_concurrency=max_concurrency
        )
        _default = CodeReward(sandbox)
        return _default


def code_reward(prompt: str, completion: str, **row: object) -> RewardDict:
    """The registered `code` reward: a shared fork-server bwrap sandbox, built on first use."""
    with _default_lock:
        reward = _default
    if reward is None:
        reward = configure_code_reward()
    return reward(prompt, completion, **row)
