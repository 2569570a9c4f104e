"""A sandbox that reuses one warmed interpreter for many programs (fork server).

`Sandbox` pays Python's start-up (about 25 ms CPU) for every program, so on a
small machine it tops out at a few dozen programs/s however many are started
ahead. Here each bwrap sandbox holds a zygote: a Python process that forks one
child per program (about 1 ms) and serves up to `programs_per_sandbox`
programs, one at a time, before it is replaced.

The namespaces, mounts and rlimits are those of `Sandbox`. What one program
could leave for the next is removed after each program: every other process
in the sandbox is killed (`kill(-1)` reaches only the sandbox's pid namespace)
and reaped (the zygote is their subreaper), and `/work`, `/tmp` and `/dev/shm`
are emptied. The zygote is not dumpable, so a program cannot open its pipes
through `/proc` or ptrace it. A program can kill the zygote (same user): that
program fails and the sandbox is replaced. Weaker than one sandbox per program
(the programs of one zygote share a kernel namespace set, SysV IPC included),
so `Sandbox` stays the default; only `isolation="bwrap"` is allowed, because
`kill(-1)` outside a pid namespace would hit the host user's processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import time

from nexrl.rewards.sandbox import ExecResult, Sandbox, SandboxLimits

# Runs inside the sandbox: one JSON request per line on stdin, one JSON result per line out.
_ZYGOTE = r"""
import ctypes, json, os, select, shutil, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(4, 0, 0, 0, 0)    # PR_SET_DUMPABLE=0: no /proc/<pid>/fd or ptrace by programs
libc.prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER: a program's orphans come back here
ctl_in, ctl_out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
null = os.open("/dev/null", os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
OUT, ERR = "/run/out/stdout", "/run/out/stderr"   # own tmpfs: a full /tmp cannot eat them

def clean():
    for d in ("/work", "/tmp", "/dev/shm", "/run/out"):
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in names:
            p = os.path.join(d, n)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    os.unlink(p)
                except OSError:
                    pass

def program(req):
    import resource
    os.setsid()
    with open("/work/stdin.txt", "w") as f:
        f.write(req["stdin"])
    for path, fd in (("/work/stdin.txt", 0), (OUT, 1), (ERR, 2)):
        flags = os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        new = os.open(path, flags, 0o600)
        os.dup2(new, fd)
        os.close(new)
    os.closerange(3, 4096)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    os.chdir("/work")
    for name, value in req["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    status = 0
    try:
        code = compile(req.pop("code"), "main.py", "exec")
        sys.argv = ["main.py"]
        exec(code, {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})
    except SystemExit as exc:
        if exc.code is None:
            status = 0
        elif isinstance(exc.code, int):
            status = exc.code & 0xFF
        else:
            print(exc.code, file=sys.stderr)
            status = 1
    except BaseException:
        import traceback
        traceback.print_exc()
        status = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        status = status or 120
    os._exit(status)

def read(path, cap):
    try:
        with open(path, "rb") as f:
            data = f.read(cap + 1)
    except OSError:
        data = b""
    return data[:cap].decode("utf-8", "replace"), len(data) > cap

for line in ctl_in:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        program(req)
    pidfd = os.pidfd_open(pid)
    timed_out = not select.select([pidfd], [], [], req["wall_s"])[0]
    os.close(pidfd)
    if timed_out:
        os.killpg(pid, signal.SIGKILL)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    while True:   # kill whatever the program left running, until nothing is left to reap
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:   # no blocking wait: a process forked during kill(-1) must get the next one
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.001)
        except ChildProcessError:
            break
    out, t1 = read(OUT, req["output_bytes"])
    err, t2 = read(ERR, req["output_bytes"])
    clean()
    ctl_out.write(json.dumps({"exit_code": None if timed_out else status, "stdout": out,
                              "stderr": err, "timed_out": timed_out,
                              "truncated": t1 or t2}).encode() + b"\n")
    ctl_out.flush()
"""


class ForkServerSandbox(Sandbox):
    """`Sandbox` whose sandboxes each serve up to `programs_per_sandbox` programs by fork.

    Same API and usage order as `Sandbox`; `pool_size` zygotes are kept warm.
    """

    _bootstrap = _ZYGOTE

    def __init__(self, *, programs_per_sandbox: int = 256, **kwargs) -> None:
        if kwargs.get("isolation", "bwrap") != "bwrap":
            raise ValueError("ForkServerSandbox needs isolation='bwrap' (kill(-1) per program)")
        if programs_per_sandbox < 1:
            raise ValueError(f"programs_per_sandbox must be >= 1, got {programs_per_sandbox}")
        self.programs_per_sandbox = programs_per_sandbox
        self._served: dict[int, int] = {}
        super().__init__(**kwargs)

    def run(self, code: str, stdin: str = "", limits: SandboxLimits | None = None) -> ExecResult:
        limits = limits or self.limits
        with self._slots:
            proc = self._take()
            result, alive = self._serve(proc, code, stdin, limits)
            pid = proc[0].pid
            self._served[pid] = self._served.get(pid, 0) + 1
            if alive and self._served[pid] < self.programs_per_sandbox:
                self._idle.put(proc)
            else:
                self._kill(proc[0])
                self._discard(proc)
                self._wanted.set()
            return result

    def _build_argv(self) -> list[str]:
        argv = super()._build_argv()
        size = (2 * self.limits.file_size_mb + 1) << 20  # stdout + stderr at their caps
        cut = argv.index("--")
        return [*argv[:cut], "--size", str(size), "--tmpfs", "/run/out", *argv[cut:]]

    def _probe(self) -> None:
        proc = self._spawn()
        result, _ = self._serve(proc, "print('ok')", "", self.limits)
        self._kill(proc[0])
        self._discard(proc)
        if result.stdout.strip() != "ok":
            super()._probe()  # the one-shot probe explains why bwrap cannot start

    def _spawn(self):
        extra = {}
        if self._uid is not None:
            extra = {"user": self._uid, "group": self._uid, "extra_groups": []}
        popen = subprocess.Popen(
            self._argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd="/",
            start_new_session=True,
            close_fds=True,
            **extra,
        )
        return popen, None, None, None

    def _serve(self, proc, code: str, stdin: str, limits: SandboxLimits) -> tuple[ExecResult, bool]:
        """(result, whether the zygote can serve again)."""
        popen = proc[0]
        request = {
            "code": code,
            "stdin": stdin,
            "rlimits": self._rlimits(limits),
            "wall_s": limits.wall_s,
            "output_bytes": limits.output_bytes,
        }
        start = time.monotonic()
        try:
            popen.stdin.write(json.dumps(request).encode() + b"\n")
            popen.stdin.flush()
        except BrokenPipeError:
            return ExecResult(None, "", "sandbox died before the program ran"), False
        line = _read_line(popen.stdout, deadline=start + limits.wall_s + 10)
        duration = time.monotonic() - start
        if line is None:  # the program killed its zygote, or the zygote hung
            return ExecResult(None, "", "the sandbox died", duration_s=duration), False
        reply = json.loads(line)
        return ExecResult(**reply, duration_s=duration), True

    @staticmethod
    def _discard(proc) -> None:
        popen = proc[0]
        for f in (popen.stdin, popen.stdout):
            if f is not None and not f.closed:
                with contextlib.suppress(OSError):
                    f.close()
        if popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, 9)
            popen.wait()


def _read_line(stream, deadline: float) -> bytes | None:
    """One line from a pipe, or None on EOF / deadline (without blocking past it)."""
    buf = b""
    fd = stream.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            buf += chunk
    return buf.split(b"\n", 1)[0]
