"""Run untrusted Python (model completions) in a bubblewrap sandbox, from a warm pool.

Isolation (`isolation="bwrap"`): new user, pid, network, ipc, uts and cgroup
namespaces (`--unshare-all`: no network at all, not even the host's
127.0.0.1; `--disable-userns`: no nested user namespace), bwrap started with
an empty environment and the program with three fixed variables, only the
system directories and the interpreter's prefix mounted read-only, `/` and
`/dev` read-only, size-capped tmpfs for every writable place (`/work`, `/tmp`,
`/dev/shm`, `/run/io`), `/proc/keys` masked, all capabilities dropped,
`--new-session`, `--die-with-parent`, and the seccomp filter of
`sandbox_seccomp` (keyrings, ptrace, pidfd, namespaces, mounts, SysV IPC, ...).
Inside, `sandbox_inside` runs as pid 1 (`--as-pid-1`: no bwrap process in the
sandbox, and pid 1 cannot be killed or stopped from inside): it forks a job
process per request, which forks one program process per case; results come
back in a frame authenticated with a per-job HMAC key that only the job
process ever holds (see that module for who sees what).

When the host runs as root, the kernel ignores RLIMIT_NPROC for root-owned
processes, so the sandbox is started as `run_as_uid` (nobody) and uses an
interpreter that user can read (`/usr/bin/python3` when the venv's lives
under `/root`).

`programs_per_sandbox` (1 here, 256 in `ForkServerSandbox`) is how many jobs
one sandbox serves before it is replaced; `pool_size` sandboxes are started
ahead of time by a background thread. A sandbox that returns anything but a
well-formed, authenticated result is discarded and the job counted in
`stats["errors"]`; its cases fail (`ExecResult.error` / `CallResult.error`).

`isolation="none_unsafe"` runs the same runner without namespaces: for
trusted code only (it can read and write anything the host user can).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from nexrl.rewards.sandbox_bwrap import (
    ENV,
    SandboxUnavailableError,
    bwrap_argv,
    find_bwrap,
    pick_python,
)
from nexrl.rewards.sandbox_io import (
    CALL_SHAPE,
    EXEC_SHAPE,
    authentic,
    read_frame,
    well_formed,
    write_all,
)
from nexrl.rewards.sandbox_seccomp import bpf_pipe

Isolation = Literal["bwrap", "none_unsafe"]
RUNNER = (Path(__file__).with_name("sandbox_inside.py")).read_text()
MAX_CASES = 8
"""Programs per job: a reward's tests are sent in jobs of at most this many."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-program limits (rlimits set inside the sandbox, wall clock enforced inside and out)."""

    wall_s: float = 10.0
    """Wall-clock limit of each program; the program is killed after it."""
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
    """Size of each writable tmpfs (/tmp, /work, /dev/shm); /run/io, which holds the stdio
    files of a job's programs, gets this plus 2 * file_size_mb per program."""
    output_bytes: int = 1 << 20
    """At most this much of stdout and of stderr is returned to the caller."""


@dataclass
class ExecResult:
    """What one program did. `exit_code` is None when it was killed for the wall clock or
    the sandbox failed (`error` says how: no, late, malformed or unauthenticated result)."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.error is None


@dataclass
class CallResult:
    """One function-call test: its code ran without raising against the program's functions."""

    passed: bool
    timed_out: bool = False
    detail: str = ""
    error: str | None = None


@dataclass
class _Box:
    popen: subprocess.Popen
    workdir: str | None
    served: int = 0


_T = TypeVar("_T")


class Sandbox:
    """A pool of pre-started sandboxes; `run`, `run_cases`, `run_calls` are thread-safe.

    Usage order: construct (probes isolation, raises SandboxUnavailableError),
    call `run` / `arun` / `submit` / `run_cases` / `run_calls` from any threads
    or tasks, `close()` at the end.
    """

    def __init__(
        self,
        *,
        isolation: Isolation = "bwrap",
        limits: SandboxLimits | None = None,
        pool_size: int = 4,
        max_concurrency: int = 64,
        python: str | None = None,
        run_as_uid: int | None = 65534,
        programs_per_sandbox: int = 1,
    ) -> None:
        if isolation not in ("bwrap", "none_unsafe"):
            raise ValueError(
                f"sandbox isolation {isolation!r} is not one of 'bwrap', 'none_unsafe'"
            )
        if programs_per_sandbox < 1:
            raise ValueError(f"programs_per_sandbox must be >= 1, got {programs_per_sandbox}")
        self.isolation = isolation
        self.limits = limits or SandboxLimits()
        self.programs_per_sandbox = programs_per_sandbox
        self.stats = {"jobs": 0, "errors": 0}
        self._stats_lock = threading.Lock()
        self._uid = run_as_uid if (os.geteuid() == 0 and isolation == "bwrap") else None
        self.python = python or pick_python(self._uid)
        self._bwrap = find_bwrap() if isolation == "bwrap" else None
        self._argv = self._build_argv()
        self._idle: queue.SimpleQueue[_Box] = queue.SimpleQueue()
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
        return self.run_cases(code, [stdin], limits)[0]

    def run_cases(
        self, code: str, stdins: Sequence[str], limits: SandboxLimits | None = None
    ) -> list[ExecResult]:
        """`run` for each stdin (at most MAX_CASES), as concurrent programs of one job."""
        limits = limits or self.limits
        _check_cases(stdins)
        prog = {"mode": "stdio", "code": code, "setup": "", "stdins": list(stdins), "names": []}
        start = time.monotonic()
        results, error = self._job(prog, {}, limits, deadline_s=limits.wall_s)
        duration = time.monotonic() - start
        if results is None or not well_formed(results, len(stdins), EXEC_SHAPE):
            error = error or "malformed results"
            self._count_error()
            return [ExecResult(None, "", "", error=error, duration_s=duration) for _ in stdins]
        return [
            ExecResult(code_, out, err, timed_out, truncated, duration)
            for code_, out, err, timed_out, truncated in results
        ]

    def run_calls(
        self,
        code: str,
        tests: Sequence[str],
        names: Sequence[str],
        setup: str = "",
        limits: SandboxLimits | None = None,
    ) -> list[CallResult]:
        """Run each test's code (at most MAX_CASES) against its own copy of the program.

        The program (`setup` + `code`) runs in a program process per test; each
        test's code runs at the same time in its own checker process (forked
        from the job process, each with `wall_s`), where each of `names` is a stub that calls the
        program's function of that name and gets back its result converted to
        plain builtin values (anything else fails the test). The test code, its
        expected values and the key never enter a program process.
        """
        limits = limits or self.limits
        _check_cases(tests)
        prog = {"mode": "call", "code": code, "setup": setup, "stdins": [""] * len(tests)}
        prog["names"] = list(names)
        deadline = limits.wall_s * 2  # the programs start, then the tests run side by side
        results, error = self._job(prog, {"tests": list(tests)}, limits, deadline_s=deadline)
        if results is None or not well_formed(results, len(tests), CALL_SHAPE):
            self._count_error()
            return [CallResult(False, error=error or "malformed results") for _ in tests]
        return [CallResult(p, t, d) for p, t, d in results]

    def submit(
        self, code: str, stdin: str = "", limits: SandboxLimits | None = None
    ) -> concurrent.futures.Future[ExecResult]:
        """`run` on the sandbox's own threads (up to `max_concurrency` at once)."""
        return self._executor.submit(self.run, code, stdin, limits)

    def submit_fn(self, fn: Callable[..., _T], *args: object) -> concurrent.futures.Future[_T]:
        """Any of the run methods on the sandbox's own threads."""
        return self._executor.submit(fn, *args)

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
                box = self._idle.get_nowait()
            except queue.Empty:
                break
            self._discard(box)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- set-up ------------------------------------------------------------

    def _build_argv(self) -> list[str]:
        """bwrap's arguments up to the seccomp fd, which differs per start."""
        if self.isolation == "none_unsafe":
            return []
        io_mb = self.limits.tmpfs_mb + 2 * MAX_CASES * self.limits.file_size_mb
        return bwrap_argv(
            self._bwrap, self._uid, self.python, self.limits.tmpfs_mb << 20, io_mb << 20
        )

    def _probe(self) -> None:
        """Run one trivial program now, so a host without isolation fails at construction."""
        box = self._spawn()
        prog = {"mode": "stdio", "code": "print('ok')", "setup": "", "stdins": [""], "names": []}
        results, error = self._exchange(box, prog, {}, self.limits, self.limits.wall_s + 20)
        self._discard(box)
        if not results or results[0][1].strip() != "ok":
            raise SandboxUnavailableError(
                f"the sandbox cannot start a program (isolation={self.isolation!r}, python="
                f"{self.python}): {error or results}. bubblewrap needs "
                "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; on "
                "Ubuntu >= 23.10 also kernel.apparmor_restrict_unprivileged_userns=0 or the "
                "distribution's bubblewrap with its AppArmor profile)"
            )

    # -- the pool ----------------------------------------------------------

    def _spawn(self) -> _Box:
        extra: dict[str, Any] = {}
        if self._uid is not None:
            extra = {"user": self._uid, "group": self._uid, "extra_groups": []}
        workdir: str | None = None
        pass_fds: tuple[int, ...] = ()
        if self.isolation == "none_unsafe":
            workdir = tempfile.mkdtemp(prefix="nexrl-unsafe-")
            paths = {"work": f"{workdir}/work", "io": f"{workdir}/io"}
            for d in paths.values():
                os.mkdir(d)
            paths["writable"] = list(paths.values())  # type: ignore[assignment]
            argv = [self.python, "-I", "-S", "-c", RUNNER, json.dumps(paths)]
        else:
            seccomp = bpf_pipe()
            pass_fds = (seccomp,)
            argv = [*self._argv, "--seccomp", str(seccomp), "--"]
            argv += [self.python, "-I", "-S", "-c", RUNNER, "{}"]
        try:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                cwd=workdir or "/",
                env=dict(ENV, HOME=workdir or "/work"),
                start_new_session=True,  # one process group to kill
                close_fds=True,
                pass_fds=pass_fds,
                **extra,
            )
        finally:
            for fd in pass_fds:
                os.close(fd)
        return _Box(popen, workdir)

    def _take(self) -> _Box:
        while True:
            try:
                box = self._idle.get_nowait()
            except queue.Empty:
                return self._spawn()
            if box.popen.poll() is None:
                return box
            self._discard(box)  # died while waiting (should not happen)

    def _refill_loop(self) -> None:
        while not self._closed.is_set():
            self._wanted.wait()
            self._wanted.clear()
            while not self._closed.is_set() and self._idle.qsize() < self._pool_size:
                self._idle.put(self._spawn())

    # -- one job -----------------------------------------------------------

    def _job(
        self, prog: dict, secret: dict, limits: SandboxLimits, deadline_s: float
    ) -> tuple[list | None, str | None]:
        prog["rlimits"] = self._rlimits(limits)
        prog["wall_s"], prog["output_bytes"] = limits.wall_s, limits.output_bytes
        with self._slots:
            box = self._take()
            try:
                results, error = self._exchange(box, prog, secret, limits, deadline_s + 5)
            except EOFError:  # a reused sandbox retired after its last job: use a fresh one
                self._discard(box)
                box = self._spawn()
                results, error = self._exchange(box, prog, secret, limits, deadline_s + 5)
            box.served += 1
            if (
                error is None
                and box.served < self.programs_per_sandbox
                and not self._closed.is_set()
            ):
                self._idle.put(box)
            else:
                self._discard(box)
                self._wanted.set()
        return results, error

    def _exchange(
        self, box: _Box, prog: dict, secret: dict, limits: SandboxLimits, deadline_s: float
    ) -> tuple[list | None, str | None]:
        """Send one job; (results, None) if its result is well-formed and authentic."""
        prog.setdefault("rlimits", self._rlimits(limits))
        prog.setdefault("wall_s", limits.wall_s)
        prog.setdefault("output_bytes", limits.output_bytes)
        with self._stats_lock:
            self.stats["jobs"] += 1
            job_id = self.stats["jobs"]
        key = secrets.token_bytes(32)
        deadline = time.monotonic() + deadline_s + 10  # + the start of a fresh sandbox
        header = {"id": job_id, "deadline_s": deadline_s}
        frames = [header, prog, {**secret, "key": key.hex()}]
        assert box.popen.stdin is not None and box.popen.stdout is not None
        if not write_all(box.popen.stdin.fileno(), frames, deadline):
            if box.served and box.popen.poll() is not None:
                raise EOFError("the sandbox retired")
            return None, "the sandbox did not take the job (it died or hung)"
        cap = (limits.output_bytes * 2 + 4096) * MAX_CASES * 7  # JSON escapes: <= 6x
        try:
            frame = read_frame(box.popen.stdout.fileno(), deadline, cap)
        except EOFError:
            if box.served:
                raise
            frame = None
        if frame is None:
            return None, "no result from the sandbox (it died, hung or sent too much)"
        return authentic(frame, key, job_id)

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

    def _count_error(self) -> None:
        with self._stats_lock:
            self.stats["errors"] += 1

    @staticmethod
    def _discard(box: _Box) -> None:
        popen = box.popen
        for f in (popen.stdin, popen.stdout):
            if f is not None and not f.closed:
                with contextlib.suppress(OSError):
                    f.close()
        if popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
        popen.wait()
        if box.workdir:
            shutil.rmtree(box.workdir, ignore_errors=True)


def _check_cases(cases: Sequence[str]) -> None:
    if not 1 <= len(cases) <= MAX_CASES:
        raise ValueError(f"a sandbox job has 1 to {MAX_CASES} cases, got {len(cases)}")


__all__ = [
    "MAX_CASES",
    "CallResult",
    "ExecResult",
    "Sandbox",
    "SandboxLimits",
    "SandboxUnavailableError",
    "find_bwrap",
]
