"""The seccomp filter bubblewrap installs in every sandbox (built with libseccomp).

Namespaces hide the host's files, network and processes; they do not cover
the kernel interfaces that are global or that reach across processes of the
same user. Those syscalls fail with EPERM inside the sandbox:

- the kernel keyrings (`keyctl`, `add_key`, `request_key`): the host's session
  keyring is inherited across fork and exec;
- other processes' memory and descriptors (`ptrace`, `process_vm_readv/writev`,
  `pidfd_open`, `pidfd_getfd`, `pidfd_send_signal`, `kcmp`);
- new namespaces and mounts (`unshare`, `setns`, `clone` with any `CLONE_NEW*`
  flag, `clone3` whose flags seccomp cannot read: it gets ENOSYS so libc falls
  back to `clone`; `mount` and the new mount API, `pivot_root`, `chroot`);
- state that outlives a process and so would pass data to the next program of
  a fork server: System V IPC and POSIX message queues;
- large kernel attack surface an untrusted program never needs: `bpf`,
  `perf_event_open`, `userfaultfd`, `io_uring_*`, module loading, `kexec`,
  `reboot`, `swapon`, `syslog`, clock setting, `open_by_handle_at`, ...

Syscalls of other ABIs (i386, x32 on x86-64) kill the process (libseccomp's
default for a foreign architecture), so they cannot bypass the list.
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile

DENIED = [
    "keyctl",
    "add_key",
    "request_key",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_open",
    "pidfd_getfd",
    "pidfd_send_signal",
    "kcmp",
    "unshare",
    "setns",
    "mount",
    "umount",
    "umount2",
    "pivot_root",
    "chroot",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "shmget",
    "shmat",
    "shmdt",
    "shmctl",
    "semget",
    "semop",
    "semtimedop",
    "semctl",
    "msgget",
    "msgsnd",
    "msgrcv",
    "msgctl",
    "mq_open",
    "mq_unlink",
    "mq_timedsend",
    "mq_timedreceive",
    "mq_notify",
    "mq_getsetattr",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "syslog",
    "lookup_dcookie",
    "open_by_handle_at",
    "name_to_handle_at",
    "iopl",
    "ioperm",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "vhangup",
    "fanotify_init",
    "nfsservctl",
    "modify_ldt",
    "uselib",
    "personality",
]
CLONE_NEW_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
    "CLONE_NEWTIME": 0x00000080,
}


class SeccompUnavailableError(RuntimeError):
    """libseccomp (or its Python binding, `pyseccomp`) is not installed."""


@functools.lru_cache(maxsize=1)
def filter_bpf() -> bytes:
    """The compiled BPF program (what bwrap's `--seccomp FD` reads), built once per process."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as exc:  # OSError: libseccomp.so.2 itself is missing
        raise SeccompUnavailableError(
            "the sandbox's seccomp filter needs libseccomp and its binding: pip install "
            "pyseccomp (in the `rewards` extra) and apt-get install libseccomp2"
        ) from exc
    filt = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED:
        try:
            filt.add_rule(sc.ERRNO(errno.EPERM), name)
        except (ValueError, RuntimeError, OSError):
            continue  # unknown to this libseccomp / architecture: the kernel has no such call
    for flag in CLONE_NEW_FLAGS.values():
        filt.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    filt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as f:
        filt.export_bpf(f)
        f.seek(0)
        return f.read()


def bpf_pipe() -> int:
    """A pipe's read end holding the filter, for one bwrap start (the caller closes it)."""
    data = filter_bpf()
    read, write = os.pipe()
    try:
        os.write(write, data)  # a few KB, well under a pipe's buffer
    finally:
        os.close(write)
    return read
