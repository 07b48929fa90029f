"""The jail's seccomp filter, built by libseccomp and handed to bwrap (`--seccomp FD`).

Everything is allowed except what a REPL has no use for and an attacker would want: debugging
other processes, the kernel keyring, BPF, mounting and namespaces, loading kernel modules,
socket families beyond Unix, IPv4 and IPv6 (the network namespace has only a loopback anyway),
and every way for the interpreter, stopped between cells, to have SIGCONT sent to itself
(POSIX timers, message-queue notices, F_SETSIG, a child's exit signal other than SIGCHLD).
Denied calls fail with EPERM (EAFNOSUPPORT for sockets) instead of killing the REPL, so user code
gets a normal Python error. Calls made for another architecture (i386 on x86-64) are refused by
libseccomp's architecture check.
"""

from __future__ import annotations

import errno
import importlib
import os
import signal
import socket
import tempfile
from typing import Any


def load_libseccomp() -> Any:
    """libseccomp's own Python bindings when the distribution ships them, else the same API over
    ctypes (pyseccomp, from PyPI). Both drive the same C library."""
    try:
        return importlib.import_module("seccomp")
    except ImportError:
        return importlib.import_module("pyseccomp")


DENIED_SYSCALLS = (
    # looking into or steering other processes
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    # the kernel keyring
    "keyctl",
    "add_key",
    "request_key",
    # BPF, perf, userfaultfd, io_uring: large kernel surfaces
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    # mounts and namespaces
    "mount",
    "umount2",
    "pivot_root",
    "unshare",
    "setns",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsmount",
    "fsconfig",
    "fspick",
    "mount_setattr",
    "name_to_handle_at",
    "open_by_handle_at",
    # the machine itself
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "syslog",
    "iopl",
    "ioperm",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "fanotify_init",
    "lookup_dcookie",
    # a stopped interpreter waking itself between cells: a POSIX timer or a message-queue
    # notice can deliver SIGCONT to it with no process running (interval timers send SIGALRM)
    "timer_create",
    "mq_notify",
)
# The signal a process asks to be sent to it (F_SETSIG: for async I/O, leases and dnotify), or to
# its parent when it ends (clone's low byte): anything but SIGCHLD could be SIGCONT.
F_SETSIG = 10
CLONE_SIGNAL_MASK = 0xFF
ALLOWED_FAMILIES = frozenset({socket.AF_UNIX, socket.AF_INET, socket.AF_INET6})
MAX_FAMILY = 256  # AF_MAX is 46 today; room for what newer kernels add (the kernel refuses >= AF_MAX)


def build_filter() -> bytes:
    """The compiled BPF program (libseccomp does the compiling; nothing here assembles BPF)."""
    libseccomp = load_libseccomp()
    syscall_filter = libseccomp.SyscallFilter(defaction=libseccomp.ALLOW)
    for name in DENIED_SYSCALLS:
        try:
            syscall_filter.add_rule(libseccomp.ERRNO(errno.EPERM), name)
        except (ValueError, OSError):
            continue  # not a syscall on this architecture or this libseccomp
    # The kernel reads the family as a 32-bit int: compare the low 32 bits only, or a family
    # with high bits set (`(1 << 32) | AF_NETLINK`) would slip past an exact 64-bit compare.
    refuse = libseccomp.ERRNO(errno.EAFNOSUPPORT)
    for family in range(MAX_FAMILY):
        if family not in ALLOWED_FAMILIES:
            low32 = libseccomp.Arg(0, libseccomp.MASKED_EQ, 0xFFFFFFFF, family)
            syscall_filter.add_rule(refuse, "socket", low32)
            syscall_filter.add_rule(refuse, "socketpair", low32)
    # clone3 passes its exit signal in a struct the filter cannot read: ENOSYS makes the C
    # library fall back to clone, whose flags it can.
    syscall_filter.add_rule(libseccomp.ERRNO(errno.ENOSYS), "clone3")
    for number in range(1, CLONE_SIGNAL_MASK + 1):
        if number != signal.SIGCHLD:
            exit_signal = libseccomp.Arg(0, libseccomp.MASKED_EQ, CLONE_SIGNAL_MASK, number)
            syscall_filter.add_rule(libseccomp.ERRNO(errno.EPERM), "clone", exit_signal)
    set_signal = libseccomp.Arg(1, libseccomp.MASKED_EQ, 0xFFFFFFFF, F_SETSIG)
    syscall_filter.add_rule(libseccomp.ERRNO(errno.EPERM), "fcntl", set_signal)
    with tempfile.TemporaryFile() as out:
        syscall_filter.export_bpf(out)
        out.seek(0)
        return out.read()


def filter_fd(program: bytes) -> int:
    """A fresh, readable fd holding the program, for one bwrap to read (the caller closes it)."""
    fd = os.memfd_create("fleet-seccomp", os.MFD_CLOEXEC)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
