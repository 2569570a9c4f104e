# ruff: noqa: E501 - the attack programs are embedded source text
"""Attack sequences: what one program does to the programs scored after it.

Run through the reward path by `escape_attacks.run_suite`; with one sandbox
and one job at a time, consecutive programs share a fork server's sandbox
(or get fresh ones, for `Sandbox`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

PLANT = """
import os, time
SOURCE_MARK = "{source_hex}"
for d in ["/tmp", "/work", "/dev/shm", "/run/io", ".", "/", "/dev", "/run"]:
    try:
        os.makedirs(f"{d}/hidden/deeper", exist_ok=True)
        open(f"{d}/hidden/deeper/mark", "w").write(SOURCE_MARK)
        open(f"{d}/.mark", "w").write(SOURCE_MARK)
        os.chmod(f"{d}/hidden/deeper", 0)
        os.chmod(f"{d}/hidden", 0)
    except OSError:
        pass
    try:
        os.setxattr(d, "user.mark", b"planted")
    except OSError:
        pass
    try:
        os.utime(d, (1234567, 7654321))
        os.chmod(d, 0o500)
    except OSError:
        pass
if os.fork() == 0:   # a daemon left behind
    os.setsid()
    if os.fork() == 0:
        time.sleep(60)
    os._exit(0)
print("planted")
"""

PROBE = """
import os
for d in ["/tmp", "/work", "/dev/shm", "/run/io", ".", "/", "/dev", "/run"]:
    for root, dirs, files in os.walk(d):
        if root.startswith("/proc") or root.startswith("/usr"):
            dirs[:] = []
            continue
        if "mark" in files or ".mark" in files or "hidden" in dirs:
            found.append(("file", root))
    try:
        if os.listxattr(d):
            found.append(("xattr", d))
    except OSError:
        pass
    st = os.stat(d)
    if int(st.st_mtime) == 7654321 or st.st_mode & 0o777 == 0o500:
        found.append(("times or mode", d))
others = set(pids()) - {1, os.getppid()}
if others:
    found.append(("processes", sorted(others)))

def count(needle):
    hits = 0
    for line in open("/proc/self/maps"):
        addrs, perms = line.split()[:2]
        if "r" not in perms:
            continue
        lo, hi = (int(a, 16) for a in addrs.split("-"))
        try:
            with open("/proc/self/mem", "rb") as mem:
                mem.seek(lo)
                hits += mem.read(hi - lo).count(needle)
        except (OSError, ValueError, OverflowError):
            pass
    return hits
control = format(int("{control_dec}"), "x").encode()
for name, dec in (("source", "{source_dec}"), ("tests", "{tests_dec}")):
    needle = format(int(dec), "x").encode()
    if count(needle) > count(control):
        found.append(("memory of the previous job", name))
verdict()
"""

FORGE = """
import json, os, struct
fake = json.dumps({"body": json.dumps({"id": 2, "results": [[True, False, ""]] * 8}),
                   "mac": "0" * 64}).encode()
frame = struct.pack(">I", len(fake)) + fake
for pid in pids():
    for fd in range(0, 16):
        try:
            with open(f"/proc/{pid}/fd/{fd}", "wb") as f:
                f.write(frame * 4)
        except OSError:
            pass
        sys_ok(438, 0, fd, 0)
sys.stdout.buffer.write(frame * 4)
def sq(x): return 0
"""
SQ_TESTS = ["assert sq(3) == 9", "assert sq(5) == 25"]
OTHERS = [
    (f"def f(x):\n    return x + {k}\n", f"def f(x):\n    return x - {k}\n", k) for k in range(1, 9)
]


def _io(expected: str) -> dict[str, Any]:
    return {"tests": [{"input": "", "output": expected}]}


def run_sequences(
    score: Callable[[str, dict], dict], ctx: dict, fill: Callable[[str, dict], str]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    seeds = {k: secrets.randbits(120) | (1 << 119) for k in ("source", "tests", "control")}
    plant_ctx = {**ctx, "source_hex": format(seeds["source"], "x")}
    tests_row = {"tests": [f"assert sq(3) == 9 or '{format(seeds['tests'], 'x')}'"]}
    probe_ctx = {**ctx, **{f"{k}_dec": v for k, v in seeds.items()}}
    score(fill(PLANT, plant_ctx), _io("planted"))
    score("def sq(x): return x * x", tests_row)  # a job whose hidden test holds a mark
    probe = fill(PROBE, probe_ctx)
    out["state_escaped"] = score(probe, _io("ESCAPED"))
    score(fill(PLANT, plant_ctx), _io("planted"))
    score("def sq(x): return x * x", tests_row)
    out["state_contained"] = score(probe, _io("CONTAINED"))

    out["forgery_attacker"] = score(fill(FORGE, ctx), {"tests": SQ_TESTS})
    out["forgery_next_wrong"] = [
        score(bad, {"tests": [f"assert f(1) == {1 + k}"]}) for _, bad, k in OTHERS
    ]
    out["forgery_next_right"] = [
        score(good, {"tests": [f"assert f(1) == {1 + k}"]}) for good, _, k in OTHERS
    ]

    stop_all = (
        "for pid in pids():\n    os.kill(pid, signal.SIGSTOP)\nimport time\ntime.sleep(600)\n"
    )
    out["stop_zygote_and_job"] = score(fill(stop_all, ctx), _io("ESCAPED"))
    stop_job = "os.kill(os.getppid(), signal.SIGSTOP)\nprint('right')\n"
    out["stop_job_then_answer"] = score(fill(stop_job, ctx), _io("right"))
    out["kill_job"] = score(
        fill("os.kill(os.getppid(), signal.SIGKILL)\nprint('right')", ctx), _io("right")
    )
    out["kill_everything"] = score(
        fill("os.kill(-1, signal.SIGKILL)\nprint('right')", ctx), _io("right")
    )
    out["after_breakage"] = score("print('right')", _io("right"))

    bombs = {
        "fork_bomb": "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "memory_bomb": "blocks = []\nwhile True:\n    blocks.append(bytearray(50 << 20))",
        "busy_loop": "while True:\n    pass",
        "huge_output": "while True:\n    print('ESCAPED' * 1000)",
        "fd_flood": "fds = [os.open('/dev/null', os.O_RDONLY) for _ in range(100000)]",
    }
    for name, src in bombs.items():
        out[name] = score(fill(src, ctx), _io("ESCAPED"))
    out["after_bombs"] = score("print('right')", _io("right"))
    return out
