"""A sandbox that serves many jobs before it is replaced (fork server).

`Sandbox` starts bwrap and a Python interpreter for every job (about 25 ms
CPU, mostly interpreter start-up), so on a small machine it tops out at a few
dozen jobs/s. Here each bwrap sandbox serves up to `programs_per_sandbox`
jobs: its pid 1 (a zygote that never reads code, tests or keys) forks a job
process per request from its clean memory, and after each job kills every
other process of the sandbox, empties every writable mount (`/work`, `/tmp`,
`/dev/shm`, `/run/io`; `/` and `/dev` are read-only) and resets their mode,
times and extended attributes, or retires if it cannot. What persists in a
kernel beyond a process (SysV IPC, POSIX message queues, keyrings) is denied
by seccomp. So a program sees nothing of the programs before it in the same
sandbox; it shares their namespaces (same hostname, an empty loopback-only
network), which hold no state a program can set (no capabilities).

Same API and usage order as `Sandbox`; it is the default behind the
registered `code` reward.
"""

from __future__ import annotations

from typing import Any

from nexrl.rewards.sandbox import Sandbox


class ForkServerSandbox(Sandbox):
    """`Sandbox` whose sandboxes each serve up to `programs_per_sandbox` jobs."""

    def __init__(self, *, programs_per_sandbox: int = 256, **kwargs: Any) -> None:
        if kwargs.get("isolation", "bwrap") != "bwrap":
            raise ValueError("ForkServerSandbox needs isolation='bwrap' (kill(-1) per program)")
        super().__init__(programs_per_sandbox=programs_per_sandbox, **kwargs)


__all__ = ["ForkServerSandbox"]
