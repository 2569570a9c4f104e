"""Small tools for agent recipes (Python functions; `LocalToolingEnv` builds their schemas)."""

from __future__ import annotations

from typing import Literal


def calculator(a: float, b: float, op: Literal["+", "-", "*", "/"]) -> float | int:
    """Exact arithmetic on two numbers: a op b.

    Args:
        a: The left operand.
        b: The right operand.
        op: The operation: "+", "-", "*" or "/".
    """
    value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else float("nan")}[op]
    return int(value) if float(value).is_integer() else round(value, 6)
