"""The sandbox's pid 1: runs jobs sent by the host, one after the other (stdlib only).

The host passes this file's text to `python -c` inside bubblewrap; it never
imports nexrl. Three kinds of process, each seeing only what it must:

- the zygote (this process, pid 1 of the sandbox's pid namespace, so nothing
  inside can kill or stop it) reads only a tiny header per job (a job id and
  a deadline), forks one job process and waits for it. It never reads code,
  tests or secrets, so every job process starts from the same clean memory.
  After the job it kills every other process in the namespace, empties the
  writable directories and retires (exits) if it cannot.
- the job process reads the program frame (code, stdins, limits), forks one
  program process per case, and only then reads the secret frame (the
  per-job HMAC key and any hidden test code). It grades (runs the tests'
  code, which calls into the programs over sockets) and writes one result
  frame, authenticated with the key.
- a program process closes every inherited descriptor but its own socket,
  sets its rlimits and runs the untrusted code. It never holds the control
  pipes, the key or the tests; seccomp (set by bwrap) and non-dumpable
  parents keep it from reaching them.

Frames are a 4-byte big-endian length and a JSON body.
"""

import builtins
import contextlib
import ctypes
import hashlib
import hmac
import json
import os
import resource
import select
import signal
import socket
import stat
import struct
import sys
import time

MAX_FRAME = 256 << 20
# Set by main() from argv[1]: where programs run and where their stdio files go, and the
# directories emptied after each job (in bwrap: the sandbox's only writable mounts).
PATHS = {"work": "/work", "io": "/run/io", "writable": ["/work", "/tmp", "/dev/shm", "/run/io"]}
PLAIN_SCALARS = (type(None), bool, int, float, str)


# -- frames ----------------------------------------------------------------


def read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError("closed")
        buf += chunk
    return bytes(buf)


def read_frame(fd, cap=MAX_FRAME):
    (n,) = struct.unpack(">I", read_exact(fd, 4))
    if n > cap:
        raise ValueError(f"frame of {n} bytes > {cap}")
    return json.loads(read_exact(fd, n))


def write_frame(fd, obj):
    data = json.dumps(obj).encode()
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(fd, data) :]


# -- plain values: the only thing that crosses from a program to the grader --


def encode(x, depth=0):
    """A JSON tree for a value built only of builtin types (exact types, no subclasses)."""
    if depth > 100:
        raise ValueError("value nested deeper than 100")
    t = type(x)
    if t is int and abs(x) > 1 << 1000:  # past the int-to-str digit limit of json
        return {"int": hex(x)}
    if t in PLAIN_SCALARS:
        return x if t is not float else {"float": repr(x)}
    if t in (list, tuple, set, frozenset):
        return {t.__name__: [encode(v, depth + 1) for v in x]}
    if t is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in x.items()]}
    if t is bytes:
        return {"bytes": x.hex()}
    if t is complex:
        return {"complex": [repr(x.real), repr(x.imag)]}
    raise TypeError(f"{t.__name__} is not a plain builtin value")


def decode(j):
    """The inverse of `encode`; anything else raises (the grader never sees a foreign type)."""
    t = type(j)
    if t in PLAIN_SCALARS and t is not float:
        return j
    if t is not dict or len(j) != 1:
        raise TypeError("malformed value")
    ((tag, v),) = j.items()
    if tag == "float" and type(v) is str:
        return float(v)
    if tag == "int" and type(v) is str:
        return int(v, 16)
    if tag == "complex" and type(v) is list and len(v) == 2:
        return complex(float(v[0]), float(v[1]))
    if tag == "bytes" and type(v) is str:
        return bytes.fromhex(v)
    if type(v) is not list:
        raise TypeError("malformed value")
    if tag == "dict":
        return {decode(k): decode(val) for k, val in v}
    kinds = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}
    if tag not in kinds:
        raise TypeError(f"unknown tag {tag!r}")
    return kinds[tag](decode(e) for e in v)


# -- a program process -------------------------------------------------------


def program(prog, i, sock_fd):
    """Never returns. Runs case `i` of `prog` with the socket as fd 3, nothing else open."""
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        base = f"{PATHS['io']}/{i}"
        with open(base + ".in", "w") as f:
            f.write(prog["stdins"][i])
        for path, fd in ((base + ".in", 0), (base + ".out", 1), (base + ".err", 2)):
            flags = os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            new = os.open(path, flags, 0o600)
            os.dup2(new, fd)
            os.close(new)
        os.dup2(sock_fd, 3)
        os.closerange(4, os.sysconf("SC_OPEN_MAX"))
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the program's std streams
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - the program's std streams
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 - the program's std streams
        os.chdir(PATHS["work"])
        for name, value in prog["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (value, value))
    except BaseException:
        os._exit(121)
    code, setup, serve = prog.pop("code"), prog.pop("setup"), prog["mode"] == "call"
    del prog
    status = run_code(setup + "\n" + code, serve)
    os._exit(status)


def run_code(source, serve):
    """Exec the program as __main__; then, in call mode, answer the grader's calls on fd 3."""
    ns = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
    sys.argv = ["main.py"]
    status = 0
    try:
        exec(compile(source, "main.py", "exec"), ns)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        status = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        status = status or 120
    if serve:
        serve_calls(ns, status)
    return status & 0xFF


def serve_calls(ns, status):
    while True:
        try:
            name, args, kwargs = read_frame(3)
        except BaseException:
            return
        try:
            if status != 0:
                raise RuntimeError(f"the program exited with status {status} before the tests")
            value = encode(ns[name](*decode(args), **decode(kwargs)))
            reply = ["ok", value]
        except BaseException as exc:  # the grader re-raises it on its side as a builtin type
            reply = ["raise", type(exc).__name__, str(exc)[:2000]]
        try:
            write_frame(3, reply)
        except BaseException:
            return


# -- the job process -----------------------------------------------------------


class Remote:
    """Stands for one of the program's names in the test code: calls go over the socket."""

    def __init__(self, sock_fd, name):
        self._fd, self.__name__ = sock_fd, name

    def __call__(self, *args, **kwargs):
        write_frame(self._fd, [self.__name__, encode(list(args)), encode(kwargs)])
        reply = read_frame(self._fd, cap=64 << 20)
        if type(reply) is list and len(reply) == 2 and reply[0] == "ok":
            return decode(reply[1])
        if type(reply) is list and len(reply) == 3 and reply[0] == "raise":
            kind = getattr(builtins, str(reply[1]), None)
            if not (isinstance(kind, type) and issubclass(kind, Exception)):
                kind = RuntimeError
            raise kind(f"{reply[1]}: {reply[2]}")
        raise TypeError("malformed reply from the program")


def job(ctl_in, result_w, header):
    os.setpgid(0, 0)
    prog = read_frame(ctl_in)
    n = len(prog["stdins"])
    kids = []
    for i in range(n):
        mine, theirs = socket.socketpair()
        try:
            pid = os.fork()
        except OSError:
            pid = -1
        if pid == 0:
            os.close(ctl_in)
            os.close(result_w)
            program(prog, i, theirs.fileno())
        theirs.close()
        kids.append((pid, mine))
    start = time.monotonic()
    del prog["code"], prog["stdins"]
    secret = read_frame(ctl_in)
    key = bytes.fromhex(secret.pop("key"))
    if prog["mode"] == "call":
        results = grade_calls(prog, secret, kids)
    else:
        results = collect_outputs(prog, kids, start)
    body = json.dumps({"id": header["id"], "results": results})
    mac = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
    for pid, sock in kids:
        kill_group(pid)
        sock.close()
    write_frame(result_w, {"body": body, "mac": mac})
    return 0


def kill_group(pid):
    if pid > 0:
        for target in (-pid, pid):
            with contextlib.suppress(OSError):
                os.kill(target, signal.SIGKILL)


def reap(pids, deadline):
    """{pid: exit code} of those of `pids` that ended before `deadline` (SIGCHLD is blocked)."""
    done = {}
    while True:
        for pid in pids:
            if pid in done or pid <= 0:
                continue
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done[pid] = None
                continue
            if got:
                done[pid] = os.waitstatus_to_exitcode(status)
        left = deadline - time.monotonic()
        if all(p in done or p <= 0 for p in pids) or left <= 0:
            return done
        signal.sigtimedwait([signal.SIGCHLD], min(left, 0.05))


def read_capped(path, cap):
    """At most `cap` bytes of a regular file (not a link, FIFO or device a program put there)."""
    data = b""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        fd = -1
    if fd >= 0:
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                data = os.read(fd, cap + 1)
        finally:
            os.close(fd)
    return data[:cap].decode("utf-8", "replace"), len(data) > cap


def collect_outputs(prog, kids, start):
    pids = [pid for pid, _ in kids]
    done = reap(pids, start + prog["wall_s"])
    for pid in pids:
        kill_group(pid)
    results = []
    for i, pid in enumerate(pids):
        out, t1 = read_capped(f"{PATHS['io']}/{i}.out", prog["output_bytes"])
        err, t2 = read_capped(f"{PATHS['io']}/{i}.err", prog["output_bytes"])
        if pid <= 0:
            err = "the sandbox could not start the program (process limit)"
        timed_out = pid > 0 and pid not in done
        code = None if timed_out or pid <= 0 else done[pid]
        results.append([code, out, err, timed_out, t1 or t2])
    return results


def grade_calls(prog, secret, kids):
    """Each test in its own checker process (forked here), all at once, sharing one deadline.

    A checker holds what this process holds (tests, key) and is as unreachable
    (not dumpable); it talks to its program process only through the stubs.
    """
    checkers = []
    for (pid, sock), test in zip(kids, secret["tests"], strict=False):
        read_end, write_end = os.pipe()
        checker = os.fork()
        if checker == 0:
            os.close(read_end)
            verdict = check(prog, pid, sock, test)
            os.write(write_end, json.dumps(verdict).encode()[:4000])
            os._exit(0)
        os.close(write_end)
        checkers.append((checker, read_end))
    done = reap([c for c, _ in checkers], time.monotonic() + prog["wall_s"])
    results = []
    for checker, read_end in checkers:
        kill_group(checker)
        verdict = [False, True, "timed out"]
        if checker in done:
            os.set_blocking(read_end, False)
            try:
                verdict = json.loads(os.read(read_end, 4096))
            except (OSError, ValueError):
                verdict = [False, False, "the checker died"]
        os.close(read_end)
        results.append(verdict)
    return results


def check(prog, pid, sock, test):
    """[passed, timed_out, detail] of one test run against program process `pid`."""
    try:
        resource.setrlimit(resource.RLIMIT_AS, (prog["rlimits"]["RLIMIT_AS"],) * 2)
        if pid <= 0:
            raise RuntimeError("the sandbox could not start the program (process limit)")
        ns = {"__name__": "__main__"}
        exec(compile(prog["setup"], "setup.py", "exec"), ns)
        for name in prog["names"]:
            ns[name] = Remote(sock.fileno(), name)
        exec(compile(test, "test.py", "exec"), ns)
        return [True, False, ""]
    except BaseException as exc:
        return [False, False, f"{type(exc).__name__}: {exc}"[:500]]


# -- the zygote ------------------------------------------------------------------


def clean(modes):
    """Empty the writable directories and reset them; False if something could not be removed."""
    for top, mode in modes.items():
        with contextlib.suppress(OSError):
            os.chmod(top, stat.S_IRWXU)
        for dirpath, dirnames, _ in os.walk(top):  # top-down: open each directory before entering
            for name in dirnames:
                path = os.path.join(dirpath, name)
                if not os.path.islink(path):
                    with contextlib.suppress(OSError):
                        os.chmod(path, stat.S_IRWXU)
        for dirpath, dirnames, filenames in os.walk(top, topdown=False):
            for name in filenames + dirnames:
                path = os.path.join(dirpath, name)
                try:
                    if os.path.isdir(path) and not os.path.islink(path):
                        os.rmdir(path)
                    else:
                        os.unlink(path)
                except OSError:
                    pass
        try:
            os.chmod(top, mode)
            for attr in os.listxattr(top):
                os.removexattr(top, attr)
            os.utime(top, (0, 0))
        except OSError:
            return False
    return all(not os.listdir(top) for top in modes)


def kill_everything(job_pid, in_namespace):
    """Kill every process but this one (pid namespace) or the job's group; reap them all."""
    while True:
        try:
            if in_namespace:
                os.kill(-1, signal.SIGKILL)
            else:
                os.kill(-job_pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.001)
        except ChildProcessError:
            return


def forward(src, dst, deadline):
    """Copy the job's one result frame to the host without reading it into this process.

    Returns "full", "none" (nothing sent: the caller reports an error) or
    "partial" (the stream to the host is broken: the caller must exit).
    """

    def wait_readable():
        left = deadline - time.monotonic()
        return left > 0 and select.select([src], [], [], left)[0]

    head = b""
    while len(head) < 4:
        chunk = os.read(src, 4 - len(head)) if wait_readable() else b""
        if not chunk:
            return "none"
        head += chunk
    (left,) = struct.unpack(">I", head)
    if left > MAX_FRAME:
        return "none"
    os.write(dst, head)
    while left:
        moved = os.splice(src, dst, left) if wait_readable() else 0
        if not moved:
            return "partial"
        left -= moved
    return "full"


def main():
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE=0: no /proc/<pid>/{fd,mem}
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    in_namespace = os.getpid() == 1
    PATHS.update(json.loads(sys.argv[1]))
    modes = {d: stat.S_IMODE(os.stat(d).st_mode) for d in PATHS["writable"] if os.path.isdir(d)}
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    while True:
        try:
            header = read_frame(ctl_in, cap=4096)
        except (EOFError, OSError, ValueError):
            return
        result_r, result_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                os.close(result_r)
                os.close(ctl_out)
                status = job(ctl_in, result_w, header)
            finally:
                os._exit(status)
        os.close(result_w)
        sent = forward(result_r, ctl_out, time.monotonic() + header["deadline_s"])
        os.close(result_r)
        kill_everything(pid, in_namespace)
        if sent == "none":
            write_frame(ctl_out, {"id": header["id"], "error": "the job gave no result in time"})
        if sent != "full" or not clean(modes):
            return


if __name__ == "__main__":
    main()
