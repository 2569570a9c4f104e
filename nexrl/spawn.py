"""The spawn start method for nexrl's child processes (the train and engine children).

A spawned child imports the parent's `__main__` script again before it runs its target,
so a script that starts a run at import, without an `if __name__ == "__main__":` guard,
starts that run again in the child.
"""

from __future__ import annotations

import multiprocessing as mp
import re
import sys
from pathlib import Path

UNGUARDED_MAIN_EXIT_CODE = 76
"""Exit status of a spawned child that, importing the parent's script again, was asked to
spawn a child itself: the script starts its run without an `if __name__ == "__main__":`."""
UNGUARDED_MAIN = (
    "stopped: the script that started the run starts it at import, without an "
    '`if __name__ == "__main__":` guard, and a spawned child imports that script again '
    "(so that its module-level registrations run there too); put the run under the guard"
)


def spawn_context() -> mp.context.SpawnContext:
    """multiprocessing's spawn context. Called while a spawned child imports the parent's
    script, it stops that child with `UNGUARDED_MAIN_EXIT_CODE` instead, so that the parent
    can say what to fix; multiprocessing would raise a RuntimeError that the parent sees
    only as "exited with status 1"."""
    if getattr(mp.current_process(), "_inheriting", False):  # set while the child imports
        print(f"nexrl: this child process {UNGUARDED_MAIN}", file=sys.stderr, flush=True)
        raise SystemExit(UNGUARDED_MAIN_EXIT_CODE)
    return mp.get_context("spawn")


_GUARD = re.compile(r"""__name__\s*==\s*["']__main__["']""")


def main_can_be_reimported() -> bool:
    """Whether a spawned child can import this process's `__main__` again without
    starting the run: it has no file (an interactive session, a notebook, `python -c`:
    the child imports nothing of it) or its source has an `if __name__ == "__main__":`
    guard (the `nexrl` and `pytest` commands, scripts written for it)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if path is None:
        return True
    try:
        return bool(_GUARD.search(Path(path).read_text(errors="replace")))
    except OSError:
        return False
