"""Frames between the host and a sandbox: 4-byte big-endian length + JSON, with deadlines.

Host side only. Every read and write is bounded by a deadline, so a sandbox
that stops reading or writing (hung, stopped, flooding) cannot block a
reward thread past it.
"""

from __future__ import annotations

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
