"""Frames between the host and a sandbox: 4-byte big-endian length + JSON, with deadlines;
the checks a result frame must pass (signed with the job's key, well-formed).

Host side only. Every read and write is bounded by a deadline, so a sandbox
that stops reading or writing (hung, stopped, flooding) cannot block a
reward thread past it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import select
import struct
import time


def write_all(fd: int, frames: list[dict], deadline: float) -> bool:
    """Write the frames; False if the reader went away or did not read them by `deadline`."""
    data = b"".join(_frame(f) for f in frames)
    os.set_blocking(fd, False)
    while data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([], [fd], [], left)[1]:
            return False
        try:
            data = data[os.write(fd, data) :]
        except BlockingIOError:
            continue
        except OSError:  # BrokenPipeError: the sandbox is gone
            return False
    return True


def read_frame(fd: int, deadline: float, cap: int) -> bytes | None:
    """One frame's body; None on EOF, a length over `cap`, or the deadline.

    Raises EOFError if the writer closed before the frame's first byte (it was gone).
    """
    ready = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]
    if ready and not (first := os.read(fd, 1)):
        raise EOFError("the sandbox closed its end")
    head = first + (_read_exact(fd, 3, deadline) or b"") if ready else None
    if head is None or len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    if n > cap:
        return None
    return _read_exact(fd, n, deadline)


def _frame(obj: dict) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack(">I", len(data)) + data


def _read_exact(fd: int, n: int, deadline: float) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


EXEC_SHAPE = ((int, type(None)), str, str, bool, bool)
CALL_SHAPE = (bool, bool, str)


def well_formed(results: object, n: int, shape: tuple[type | tuple[type, ...], ...]) -> bool:
    if type(results) is not list or len(results) != n:
        return False
    return all(
        type(r) is list
        and len(r) == len(shape)
        and all(
            isinstance(v, t) and (t is not int or type(v) is not bool)
            for v, t in zip(r, shape, strict=False)
        )
        for r in results
    )


def authentic(frame: bytes, key: bytes, job_id: int) -> tuple[list | None, str | None]:
    """The results of a result frame if its MAC checks out and it answers `job_id`."""
    try:
        msg = json.loads(frame)
    except ValueError:
        return None, "malformed result frame (not JSON)"
    if not isinstance(msg, dict):
        return None, "malformed result frame (not an object)"
    body, mac = msg.get("body"), msg.get("mac")
    if not (isinstance(body, str) and isinstance(mac, str)):
        return None, f"sandbox error: {str(msg.get('error', 'result without body and MAC'))[:200]}"
    expected = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, mac):
        return None, "result not authenticated (wrong MAC)"
    parsed = json.loads(body)  # authentic: written by our own job process
    if parsed.get("id") != job_id:
        return None, "result for another job"
    return parsed["results"], None
