"""The train child of `service.train_service.backend=process`, spawned ahead.

Its start-up is mostly imports (torch, transformers: 4 s on 2 CPU cores here, 11-13 s
on a 16-core GPU host). `nexrl train` spawns it as soon as the config is checked, before
it imports torch or the controller, so the child's imports run beside this process's own and
beside the building of the run; `ProcessTrainEngine` then takes it. This module
imports no torch: spawning costs the parent nothing.
"""

from __future__ import annotations

import threading
from typing import Any

from omegaconf import DictConfig, OmegaConf

from nexrl.config.derived import train_backend
from nexrl.spawn import spawn_context

Spawned = tuple[Any, Any]  # (the child process, the parent's end of its pipe)

_spare: Spawned | None = None  # a child spawned ahead by `prestart`
_spare_lock = threading.Lock()


def spawn() -> Spawned:
    """A new child; it imports the engine, then waits for its config."""
    ctx = spawn_context()
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child_conn,), name="nexrl-trainer", daemon=True)
    proc.start()
    child_conn.close()
    return proc, conn


def _child(conn: Any) -> None:
    from nexrl.training.process_engine import child_main  # the imports the spare runs ahead

    child_main(conn)


def prestart_for(cfg: DictConfig) -> bool:
    """Spawn the spare if `cfg` trains in a child process of this one (local launch,
    `service.train_service.backend` process, or auto resolved to it); whether it does."""
    local = OmegaConf.select(cfg, "launch_mode", default="local") == "local"
    if not local or train_backend(cfg) != "process":
        return False
    prestart()
    return True


def prestart() -> None:
    """Spawn a child now for the next `ProcessTrainEngine` to take (none if one waits)."""
    global _spare
    with _spare_lock:
        if _spare is None:
            _spare = spawn()


def take_spare() -> Spawned | None:
    """The spare child, if one is waiting (a dead one is dropped)."""
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    if spare is not None and not spare[0].is_alive():
        spare[1].close()
        return None
    return spare


def discard_spare() -> None:
    """Stop a child that `prestart` spawned and no engine took (a run that failed early)."""
    spare = take_spare()
    if spare is not None:  # it holds nothing yet: no need to wait for its imports
        proc, conn = spare
        conn.close()
        proc.kill()
        proc.join(timeout=10)
