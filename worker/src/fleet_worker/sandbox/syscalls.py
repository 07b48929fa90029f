"""The jail's seccomp filter, built by libseccomp and handed to bwrap (`--seccomp FD`).

Everything is allowed except what a REPL has no use for and an attacker would want: debugging
other processes, the kernel keyring, BPF, mounting and namespaces, loading kernel modules, and
socket families beyond Unix, IPv4 and IPv6 (the network namespace has only a loopback anyway).
Denied calls fail with EPERM (EAFNOSUPPORT for sockets) instead of killing the REPL, so user code
gets a normal Python error. Calls made for another architecture (i386 on x86-64) are refused by
libseccomp's architecture check.
"""

from __future__ import annotations

import errno
import importlib
import os
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
)
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
