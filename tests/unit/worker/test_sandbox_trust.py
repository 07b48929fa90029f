"""Which interpreter the worker may run: never one under a folder sandboxes write, nor one that
anyone but root or the worker's user could have put or replaced; and sandbox uids that no
account on the host holds."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from fleet_worker.sandbox.trust import uid_range_clash, untrusted_interpreter

SYSTEM_PYTHON = "/usr/bin/python3"


def executable(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "python3"
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


@pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON), reason="needs python3")
def test_the_systems_interpreter_is_trusted(tmp_path: Path) -> None:
    assert untrusted_interpreter(SYSTEM_PYTHON, [tmp_path]) is None


def test_one_under_a_folder_sandboxes_write_is_not(tmp_path: Path) -> None:
    data = tmp_path / "data"
    planted = executable(data / "workspaces" / "ws" / "memory")
    reason = untrusted_interpreter(str(planted), [data])
    assert reason is not None and "where sandboxed code writes" in reason


def test_a_link_to_one_there_is_followed_to_it(tmp_path: Path) -> None:
    data = tmp_path / "data"
    planted = executable(data / "memory")
    link = tmp_path / "bin" / "python3"
    link.parent.mkdir()
    link.symlink_to(planted)
    assert untrusted_interpreter(str(link), [data]) is not None


def test_one_in_a_folder_anyone_may_write_is_not(tmp_path: Path) -> None:
    folder = tmp_path / "open"
    python = executable(folder)
    folder.chmod(0o777)
    reason = untrusted_interpreter(str(python), [])
    assert reason is not None and f"anyone may write {folder}" in reason
    folder.chmod(0o1777)  # sticky, like /tmp: others cannot replace what they do not own
    assert untrusted_interpreter(str(python), []) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file away")
def test_one_owned_by_another_uid_is_not(tmp_path: Path) -> None:
    python = executable(tmp_path / "theirs")
    os.chown(python, 200_123, 200_123)
    reason = untrusted_interpreter(str(python), [])
    assert reason is not None and "owned by uid 200123" in reason


def test_sandbox_uids_must_not_be_an_accounts() -> None:
    account = pwd.getpwall()[0]
    reason = uid_range_clash(account.pw_uid, 1)
    assert reason is not None and repr(account.pw_name) in reason
    taken = {a.pw_uid for a in pwd.getpwall()}
    free = next(
        base for base in range(300_000, 10**9, 100_000) if not any(base <= u < base + 65_536 for u in taken)
    )
    assert uid_range_clash(free, 65_536) is None
