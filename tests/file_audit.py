"""Which simulated Ray node touched which file: a cross-node file read detector.

A Ray cluster simulated on one machine shares one file system, so a run that passes a
local path from one node to another works here and breaks on real machines without a
shared disk. This module records, in every process of the run, the file-system calls
on paths under a watched root, with the node the process belongs to, and then finds
every access on one node to something another node wrote:

- recording: a Python audit hook (`sys.addaudithook`, PEP 578) in the driver and in
  every Ray worker (the job's `worker_process_setup_hook`). The node is the
  `NEXRL_SIM_NODE` variable each simulated node's raylet passes to its workers
  (`Cluster.add_node(env_vars=...)`), the watched root and the log folder come from
  `NEXRL_FILE_AUDIT` (`<root>:<log dir>`). Each process appends JSON lines to its own
  log file.
- writes: `open` for writing, `os.mkdir`, the destination of `os.rename`/`os.replace`;
  a folder also counts as written by the node that created an entry in it.
- accesses: `open` for reading, `os.listdir`/`os.scandir` (folder listings, which
  `Path.iterdir`/`glob` use), `os.remove`/`os.rmdir`/`shutil.rmtree` (deleting another
  node's file needs to see it too).

Native code that opens files itself (safetensors' Rust reader and writer, torch's C++
zip writer) raises no audit event. Every reader of such a file in nexrl also opens a
file of the same folder from Python (HF's `config.json`, the checkpoint manifest,
`torch.load`), and every such folder is created with `os.mkdir` by its writer, so the
folder-level rule still attributes those reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

ENV_NODE = "NEXRL_SIM_NODE"
ENV_AUDIT = "NEXRL_FILE_AUDIT"

_state = threading.local()
_config: dict[str, str] = {}
_installed: list[bool] = []
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def install(node: str | None = None) -> None:
    """Start recording in this process (once); a no-op without `NEXRL_FILE_AUDIT`."""
    spec = os.environ.get(ENV_AUDIT)
    if not spec or _config:
        return
    root, log_dir = spec.split(os.pathsep)
    name = node or os.environ.get(ENV_NODE, "unknown")
    _config.update(
        root=os.path.abspath(root),
        node=name,
        log=os.path.join(log_dir, f"{name}-{os.getpid()}.jsonl"),
    )
    if not _installed:  # an audit hook cannot be removed: `uninstall` only mutes it
        sys.addaudithook(_hook)
        _installed.append(True)


def uninstall() -> None:
    """Stop recording in this process."""
    _config.clear()


@contextlib.contextmanager
def muted() -> Iterator[None]:
    """The test's own look at the files (this thread) is not part of the run."""
    _state.busy = True
    try:
        yield
    finally:
        _state.busy = False


def _classify(event: str, args: tuple) -> list[tuple[str, object]]:
    if event == "open":
        path, mode, flags = args
        if mode is None:
            write = bool((flags or 0) & WRITE_FLAGS)
        else:
            write = any(c in str(mode) for c in "wax+")
        return [("write" if write else "read", path)]
    if event == "os.mkdir":
        return [("write", args[0])]
    if event in ("os.rename", "os.replace"):
        return [("delete", args[0]), ("write", args[1])]
    if event in ("os.listdir", "os.scandir"):
        return [("list", args[0] if args[0] is not None else ".")]
    if event in ("os.remove", "os.rmdir", "shutil.rmtree"):
        return [("delete", args[0])]
    return []


def _hook(event: str, args: tuple) -> None:
    if getattr(_state, "busy", False) or not _config:
        return
    kinds = _classify(event, args)
    if not kinds:
        return
    root = _config["root"]
    rows = []
    for kind, path in kinds:
        if isinstance(path, int):  # a file descriptor: its path was seen when opened
            continue
        full = os.path.abspath(os.fsdecode(path))
        if full == root or full.startswith(root + os.sep):
            rows.append({"node": _config["node"], "kind": kind, "path": full, "t": time.time()})
    if not rows:
        return
    _state.busy = True
    try:
        with open(_config["log"], "a") as log:
            log.writelines(json.dumps(row) + "\n" for row in rows)
    except OSError:  # the log folder is gone: the cluster was torn down
        pass
    finally:
        _state.busy = False


def read_log(log_dir: str | Path) -> list[dict]:
    rows = []
    for path in Path(log_dir).iterdir():
        rows.extend(json.loads(line) for line in path.read_text().splitlines() if line)
    return sorted(rows, key=lambda r: r["t"])


def cross_node_accesses(rows: list[dict]) -> list[str]:
    """Every access on node B to a path (or a folder entry) that node A != B wrote
    earlier: 'read of <path> on rollout, written on train'."""
    writers: dict[str, set[str]] = {}  # path -> nodes that wrote it (so far)
    problems = []
    for row in rows:
        path, node = row["path"], row["node"]
        if row["kind"] == "write":
            writers.setdefault(path, set()).add(node)
            writers.setdefault(os.path.dirname(path), set()).add(node)  # a new entry
            continue
        others = writers.get(path, set()) - {node}
        if row["kind"] == "write" or not others:
            continue
        problems.append(f"{row['kind']} of {path} on {node}, written on {sorted(others)}")
    return problems


def nodes_that_wrote(rows: list[dict], under: str | Path) -> set[str]:
    """Nodes with a write event at or below `under`."""
    prefix = os.path.abspath(under)
    return {
        r["node"]
        for r in rows
        if r["kind"] == "write" and (r["path"] == prefix or r["path"].startswith(prefix + os.sep))
    }
