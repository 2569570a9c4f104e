# ruff: noqa: E501 - the attack programs are embedded source text
"""Attacks on the code reward, scored the way a rollout worker scores them.

Each attack is a completion given to `RewardRunner(reward)`. Most are stdio
programs that print CONTAINED when every attempt failed and ESCAPED (with
why) otherwise; each is scored twice, against the expected outputs ESCAPED
(must give 0) and CONTAINED (must give 1: proof that the attack ran). The
others are wrong solutions to function-call tests that try to pass anyway
(must give 0), sequences that check what one program leaves for the next, and
programs that break the sandbox's own machinery (must give 0 and a counted
error, never an exception).

`python escape_attacks.py KIND` runs them all and prints a JSON report; the
test runs it in-process and again as an unprivileged user. Network probes
target the host's loopback only.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import socket
import subprocess
import sys
import textwrap
import time
from typing import Any

from nexrl.rewards.code import CodeReward, configure_code_reward
from nexrl.rewards.runner import RewardRunner
from nexrl.rewards.sandbox import Sandbox, SandboxLimits
from nexrl.rewards.sandbox_forkserver import ForkServerSandbox

LIMITS = SandboxLimits(wall_s=3, cpu_s=3, memory_mb=256, nproc=16, tmpfs_mb=16, file_size_mb=4)
CANARY_NAME = "NEXRL_ESCAPE_CANARY"
HELPERS = """
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
found = []
def sys_ok(nr, *args):
    return libc.syscall(nr, *[ctypes.c_long(a) if isinstance(a, int) else a for a in args]) >= 0
def pids():
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
def verdict():
    print("ESCAPED: " + "; ".join(map(str, found)) if found else "CONTAINED")
"""

# name -> (class, program); {canary}, {port}, {udp}, {abstract}, {host_pid}, {repo},
# {host_marker} and {names} are filled in by the driver
STDIO: dict[str, tuple[str, str]] = {
    "env_all_proc_environ": (
        "host environment",
        """
        for p in os.listdir("/proc"):
            for f in (f"/proc/{p}/environ", f"/proc/{p}/task/{p}/environ"):
                try:
                    data = open(f, "rb").read()
                except OSError:
                    continue
                if b"{canary}" in data or b"{canary_name}" in data:
                    found.append(f)
        if "{canary}" in str(os.environ):
            found.append("os.environ")
        verdict()
    """,
    ),
    "env_host_variable_names": (
        "host environment",
        """
        import subprocess
        seen = set(os.environ)
        for p in ["1", "self", str(os.getppid())]:
            try:
                seen |= {v.split(b"=")[0].decode() for v in open(f"/proc/{p}/environ", "rb").read().split(b"\\0") if v}
            except OSError:
                pass
        seen |= {l.split("=")[0] for l in subprocess.run(["env"], capture_output=True, text=True).stdout.splitlines()}
        leaked = seen & set({names}) - {"PATH", "HOME", "LANG", "PWD", "SHLVL", "_"}
        if leaked:
            found.append(sorted(leaked))
        verdict()
    """,
    ),
    "keyring_syscalls": (
        "host keyring",
        """
        for ring in (-1, -2, -3, -4, -5):   # thread, process, session, user, user-session
            buf = ctypes.create_string_buffer(4096)
            if sys_ok(250, 11, ring, buf, 4096):   # KEYCTL_READ
                found.append(("read", ring))
            if sys_ok(250, 0, ring, 0):    # KEYCTL_GET_KEYRING_ID
                found.append(("id", ring))
        if sys_ok(249, b"user", b"{canary_name}", None, 0):   # request_key
            found.append("request_key")
        if sys_ok(248, b"user", b"planted", b"x", 1, -3):      # add_key to the session keyring
            found.append("add_key")
        verdict()
    """,
    ),
    "keyring_proc_files": (
        "host keyring",
        """
        for f in ("/proc/keys", "/proc/key-users", "/proc/self/keys"):
            try:
                data = open(f).read()
            except OSError:
                continue
            if "{canary_name}" in data or data.strip():
                found.append(f)
        verdict()
    """,
    ),
    "readonly_root_and_dev": (
        "uncapped writable mounts",
        """
        for d in ["/", "/dev", "/run", "/usr", "/proc", "/bin", "/lib"]:
            try:
                open(os.path.join(d, "planted"), "w").write("x")
                found.append(d)
            except OSError:
                pass
        verdict()
    """,
    ),
    "every_writable_mount_is_capped": (
        "uncapped writable mounts",
        """
        mounts = []
        for line in open("/proc/self/mountinfo"):
            left, right = line.split(" - ")
            point, opts = left.split()[4], left.split()[5]
            fstype, supers = right.split()[0], right.split()[2]
            if "rw" in opts.split(",") and fstype not in ("proc", "devpts") and os.path.isdir(point):
                if fstype != "tmpfs" or "size=" not in supers:
                    found.append(("uncapped", point, fstype))
                mounts.append(point)
        chunk = b"x" * (2 << 20)
        for point in mounts:
            total = 0
            for i in range(200):   # 400 MB
                try:
                    open(os.path.join(point, f"fill{i}"), "wb").write(chunk)
                    total += len(chunk)
                except OSError:
                    break
            if total > 120 << 20:
                found.append(("filled", point, total >> 20))
            for i in range(200):
                try:
                    os.unlink(os.path.join(point, f"fill{i}"))
                except OSError:
                    pass
        verdict()
    """,
    ),
    "forge_through_proc_fds": (
        "result forgery",
        """
        import json, struct
        fake = json.dumps({"body": json.dumps({"id": 1, "results": []}), "mac": "0" * 64}).encode()
        frame = struct.pack(">I", len(fake)) + fake
        for pid in pids():
            for d in (f"/proc/{pid}/fd", f"/proc/{pid}/task/{pid}/fd"):
                try:
                    fds = os.listdir(d)
                except OSError:
                    continue
                for fd in fds:
                    try:
                        with open(f"{d}/{fd}", "wb") as f:
                            f.write(frame)
                        found.append(f"{d}/{fd}")
                    except OSError:
                        pass
        verdict()
    """,
    ),
    "forge_pidfd_ptrace_vm": (
        "result forgery",
        """
        for pid in pids():
            if sys_ok(434, pid, 0):                      # pidfd_open
                found.append(("pidfd_open", pid))
            for fd in range(3, 8):
                if sys_ok(438, 0, fd, 0) or sys_ok(438, 3, fd, 0):   # pidfd_getfd
                    found.append(("pidfd_getfd", pid, fd))
            if sys_ok(101, 16, pid, 0, 0) or sys_ok(101, 0x4206, pid, 0, 0):   # ATTACH, SEIZE
                found.append(("ptrace", pid))
            buf = ctypes.create_string_buffer(16)
            iov = (ctypes.c_void_p * 2)(ctypes.cast(buf, ctypes.c_void_p), 16)
            riov = (ctypes.c_void_p * 2)(0x400000, 16)
            if sys_ok(310, pid, iov, 1, riov, 1, 0):      # process_vm_readv
                found.append(("process_vm_readv", pid))
            for f in ("mem", "environ", "maps"):
                try:
                    open(f"/proc/{pid}/{f}", "rb").read(1)
                    if f != "maps":
                        found.append((f, pid))
                except OSError:
                    pass
        verdict()
    """,
    ),
    "nested_namespaces": (
        "namespaces and kernel surfaces",
        """
        import subprocess
        for flag in (0x10000000, 0x00020000, 0x20000000, 0x40000000):   # USER, NS, PID, NET
            if sys_ok(272, flag):   # unshare
                found.append(("unshare", hex(flag)))
        for ns in ("user", "mnt", "net", "pid"):
            try:
                fd = os.open(f"/proc/1/ns/{ns}", os.O_RDONLY)
                if sys_ok(308, fd, 0):   # setns
                    found.append(("setns", ns))
            except OSError:
                pass
        for tool in (["unshare", "-U", "true"], ["unshare", "-r", "true"]):
            try:
                if subprocess.run(tool, capture_output=True).returncode == 0:
                    found.append(tool)
            except OSError:
                pass
        verdict()
    """,
    ),
    "kernel_surfaces": (
        "namespaces and kernel surfaces",
        """
        checks = {
            "bpf": (321, 0, None, 0), "perf_event_open": (298, None, 0, -1, -1, 0),
            "userfaultfd": (323, 0), "io_uring_setup": (425, 4, None),
            "mount": (165, b"none", b"/tmp", b"tmpfs", 0, None), "keyctl": (250, 0, -3, 0),
            "shmget": (29, 1234, 4096, 0o1666), "msgget": (68, 1234, 0o1666),
        }
        for name, (nr, *args) in checks.items():
            if sys_ok(nr, *args):
                found.append(name)
        verdict()
    """,
    ),
    "network_host_loopback": (
        "network",
        """
        import socket
        for fam, addr in ((socket.AF_INET, ("127.0.0.1", {port})), (socket.AF_INET6, ("::1", {port}))):
            try:
                socket.create_connection(addr, timeout=1)
                found.append(addr)
            except OSError:
                pass
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.sendto(b"ESCAPED", ("127.0.0.1", {udp}))
        except OSError:
            pass
        verdict()
    """,
    ),
    "network_host_abstract_unix_socket": (
        "network",
        """
        import socket
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect("\\0{abstract}")
            found.append("abstract socket")
        except OSError:
            pass
        verdict()
    """,
    ),
    "read_outside": (
        "file system",
        """
        for path in ["{repo}", "/etc/shadow", "/etc/passwd", "/root", "/home", "{host_marker}"]:
            try:
                if os.path.isdir(path):
                    os.listdir(path)
                else:
                    open(path).read()
                found.append(path)
            except OSError:
                pass
        verdict()
    """,
    ),
    "write_outside": (
        "file system",
        """
        for path in ["{host_marker}/owned", "/usr/owned", "{repo}.owned"]:
            try:
                open(path, "w").write("x")
                found.append(path)
            except OSError:
                pass
        verdict()
    """,
    ),
    "kill_host_processes": (
        "host processes",
        """
        for pid in (1, {host_pid}, {victim_pid}):   # killing the job process: escape_sequences
            try:
                os.kill(pid, signal.SIGKILL)
                if pid != 1:
                    found.append(pid)
            except OSError:
                pass
        verdict()
    """,
    ),
    "see_host_processes": (
        "host processes",
        """
        for p in os.listdir("/proc"):
            if not p.isdigit():
                continue
            if int(p) in ({host_pid}, {victim_pid}):
                found.append(p)
            try:
                cmd = open(f"/proc/{p}/cmdline", "rb").read()
            except OSError:
                continue
            if b"escape_attacks" in cmd or b"sleep(120)" in cmd:
                found.append(cmd[:80])
        verdict()
    """,
    ),
}

# wrong solutions of `def sq(x): return x * x` that try to pass its tests
SQ_TESTS = ["assert sq(3) == 9", "assert abs(sq(-2) - 4) < 1e-9", "assert sq(5) == 25"]
SQ_CORRECT = "def sq(x):\n    return x * x\n"
HACKS: dict[str, tuple[str, str]] = {
    "eq_always_true": (
        "reward hacks",
        """
        class Anything:
            def __eq__(self, other): return True
            def __ne__(self, other): return False
            def __sub__(self, other): return 0
            __rsub__ = __sub__
        def sq(x): return Anything()
    """,
    ),
    "builtin_subclasses": (
        "reward hacks",
        """
        class I(int):
            def __eq__(self, other): return True
            def __sub__(self, other): return 0
            __hash__ = int.__hash__
        def sq(x): return I(0)
    """,
    ),
    "settrace_over_the_tests": (
        "reward hacks",
        """
        import sys, threading
        def tracer(frame, event, arg):
            if event == "exception":
                frame.f_lineno = frame.f_lineno + 1
            return tracer
        sys.settrace(tracer); threading.settrace(tracer); sys.setprofile(lambda *a: None)
        def sq(x): return 0
    """,
    ),
    "patched_builtins_and_exceptions": (
        "reward hacks",
        """
        import builtins
        builtins.AssertionError = type("Fine", (Exception,), {})
        builtins.abs = lambda x: 0
        builtins.print = lambda *a, **k: None
        def sq(x): return 0
    """,
    ),
    "introspect_for_tests": (
        "reward hacks",
        """
        import gc, os, re
        def sq(x):
            texts = [o for o in gc.get_objects() if isinstance(o, str) and "sq(" in o and "==" in o]
            for pid in os.listdir("/proc"):
                try:
                    texts.append(open(f"/proc/{pid}/cmdline").read())
                except OSError:
                    pass
            for t in texts:
                m = re.search(r"sq\\(%d\\) == (\\d+)" % x, t)
                if m:
                    return int(m.group(1))
            return 0
    """,
    ),
    "exit_early": (
        "reward hacks",
        """
        import os, sys
        def sq(x):
            raise SystemExit(0)
        os._exit(0)
    """,
    ),
    "forge_the_reply": (
        "reward hacks",
        """
        import sys
        runner = sys.modules["__main__"]
        runner.encode = lambda value: {"float": "nan"} if False else True
        runner.decode = lambda value: value
        def sq(x): return 0
    """,
    ),
}


def _fill(src: str, ctx: dict[str, Any]) -> str:
    src = textwrap.dedent(src)
    for key, value in ctx.items():
        src = src.replace("{" + key + "}", str(value))
    return HELPERS + src


def _io(expected: str) -> dict[str, Any]:
    return {"tests": [{"input": "", "output": expected}]}


def plant_canaries() -> str:
    """A canary in the environment and in a new session keyring of this process."""
    canary = secrets.token_hex(16)
    os.environ[CANARY_NAME] = canary
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall(250, 1, b"nexrl-escape-suite")  # KEYCTL_JOIN_SESSION_KEYRING
    payload = canary.encode()
    key = libc.syscall(248, b"user", CANARY_NAME.encode(), payload, len(payload), -3)
    assert key > 0, f"could not add the canary key: errno {ctypes.get_errno()}"
    return canary


def make_reward(kind: str):
    if kind == "registered":
        from nexrl.rewards import get_reward_fn

        configure_code_reward(limits=LIMITS, pool_size=1, max_concurrency=1)
        return get_reward_fn("code"), None
    box = (ForkServerSandbox if kind == "fork_server" else Sandbox)(
        limits=LIMITS, pool_size=1, max_concurrency=1
    )
    return CodeReward(box), box


def run_suite(kind: str) -> dict[str, Any]:
    """Score every attack; a JSON-able report the test asserts on."""
    canary = plant_canaries()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.2)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract_name = f"nexrl-escape-{os.getpid()}"
    abstract.bind("\0" + abstract_name)
    abstract.listen(1)
    host_tmp = os.environ.get("TMPDIR", "/tmp")
    host_marker = os.path.join(host_tmp, f"host-only-{secrets.token_hex(4)}")
    os.mkdir(host_marker)
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    ctx = {
        "canary": canary,
        "canary_name": CANARY_NAME,
        "names": repr(sorted(os.environ)),
        "port": listener.getsockname()[1],
        "udp": udp.getsockname()[1],
        "abstract": abstract_name,
        "host_pid": os.getpid(),
        "victim_pid": victim.pid,
        "repo": os.path.abspath(__file__),
        "host_marker": host_marker,
    }
    reward, box = make_reward(kind)
    report: dict[str, Any] = {"uid": os.getuid(), "stdio": {}, "hacks": {}, "sequences": {}}
    with RewardRunner(reward, timeout_s=60) as runner:

        def score(code: str, row: dict) -> dict[str, Any]:
            start = time.monotonic()
            out = runner.score("p", f"```python\n{code}\n```", row=row)
            return {
                "reward": out.reward,
                "error": out.error,
                "detail": out.detail,
                "scores": out.scores,
                "seconds": time.monotonic() - start,
            }

        for name, (cls, src) in STDIO.items():
            code = _fill(src, ctx)
            report["stdio"][name] = {
                "class": cls,
                "escaped": score(code, _io("ESCAPED")),
                "contained": score(code, _io("CONTAINED")),
            }
        for name, (cls, src) in HACKS.items():
            report["hacks"][name] = {
                "class": cls,
                **score(textwrap.dedent(src), {"tests": SQ_TESTS}),
            }
        report["hacks"]["control_correct"] = score(SQ_CORRECT, {"tests": SQ_TESTS})
        report["sequences"] = sequences(score, ctx)
    for sock in (listener, udp):
        try:
            sock.accept() if sock is listener else sock.recvfrom(64)
            report["host_received"] = True
        except OSError:
            pass
    report["victim_alive"] = victim.poll() is None
    victim.kill()
    victim.wait()
    report["host_can_fork"] = subprocess.run(["true"]).returncode == 0
    report["host_tmp_owned"] = os.listdir(host_marker) != [] or os.path.exists(__file__ + ".owned")
    if box is not None:
        report["stats"] = dict(box.stats)
        box.close()
    return report


def sequences(score, ctx: dict) -> dict[str, Any]:
    """Attacks whose effect shows in the programs scored after them (same fork server)."""
    from tests.integration.rewards.escape_sequences import run_sequences

    return run_sequences(score, ctx, _fill)


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    print(json.dumps(run_suite(sys.argv[1])))
