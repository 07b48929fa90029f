"""The REPL driver is staged compiled by the sandbox's own interpreter (never as root), under the
name the REPL runs it as; an interpreter that cannot compile it gets the source, a changed
interpreter gets it staged anew, and a dead worker's staging folder is swept."""

from __future__ import annotations

import marshal
import os
import shutil
import sys
from pathlib import Path

import pytest

from fleet_worker.sandbox.boundary import Caps
from fleet_worker.sandbox.driver import PREFIX, stage_driver, sweep_staged
from fleet_worker.sandbox.jail import DRIVER_SOURCE, LocalSandboxConfig, driver_mount
from fleet_worker.sandbox.local import Isolation, LocalSandboxProvider

PYTHON = sys.executable  # the pyc is read back below by this same interpreter


def code_of(pyc: Path) -> object:
    return marshal.loads(pyc.read_bytes()[16:])  # after the header: magic, flags, two words


@pytest.mark.parametrize("isolated", [True, False])
def test_the_driver_is_staged_compiled_under_the_name_it_runs_as(isolated: bool) -> None:
    staged = stage_driver(PYTHON, isolated, compile_as=None)
    try:
        path = staged.path
        assert path.suffix == ".pyc" and path.parent.name.startswith(f"{PREFIX}{os.getpid()}-")
        assert path.stat().st_mode & 0o777 == 0o444 and path.parent.stat().st_mode & 0o777 == 0o755
        seen_as = driver_mount(path) if isolated else str(path)
        assert getattr(code_of(path), "co_filename", None) == seen_as  # its frames stay out of tracebacks
        assert staged.current(PYTHON, isolated) and not staged.current(PYTHON, not isolated)
    finally:
        shutil.rmtree(staged.path.parent)


SYSTEM_PYTHON = "/usr/bin/python3"  # one any uid may run (this venv's may sit under /root)


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON), reason="needs root and python3")
def test_a_root_worker_compiles_as_a_sandbox_uid(traversable_dir: Path) -> None:
    spy = traversable_dir / "python3"  # records who ran it, then compiles as the real one would
    spy.write_text(f'#!/bin/sh\nid -u > {traversable_dir}/uid\nexec {SYSTEM_PYTHON} "$@"\n')
    spy.chmod(0o755)
    traversable_dir.chmod(0o777)
    staged = stage_driver(str(spy), isolated=True, compile_as=200_123)
    try:
        assert (traversable_dir / "uid").read_text().strip() == "200123"
        assert staged.path.suffix == ".pyc"
    finally:
        shutil.rmtree(staged.path.parent)


def test_an_interpreter_that_cannot_compile_gets_the_source(tmp_path: Path) -> None:
    for body in ("exit 1", "exit 0"):  # fails, or "succeeds" with no bytecode
        broken = tmp_path / "python3"
        broken.write_text(f"#!/bin/sh\n{body}\n")
        broken.chmod(0o755)
        staged = stage_driver(str(broken), isolated=True, compile_as=None)
        try:
            assert staged.path.name == "repl_main.py"
            assert staged.path.read_bytes() == DRIVER_SOURCE.read_bytes()
        finally:
            shutil.rmtree(staged.path.parent)


def test_a_changed_interpreter_gets_the_driver_staged_anew(tmp_path: Path) -> None:
    python = tmp_path / "python3"
    python.symlink_to(PYTHON)
    provider = LocalSandboxProvider(LocalSandboxConfig(), caps=Caps(), workspaces=tmp_path)
    isolation = Isolation(bwrap=None, python=str(python))
    try:
        first = provider._staged_driver(isolation)
        assert provider._staged_driver(isolation) == first  # the same copy while nothing changed
        python.unlink()
        python.symlink_to(SYSTEM_PYTHON)  # "an upgrade"
        if os.path.realpath(python) == os.path.realpath(PYTHON):
            pytest.skip("this host has one Python only")
        second = provider._staged_driver(isolation)
        assert second != first and not first.exists() and second.exists()
    finally:
        provider.close()


def test_a_dead_workers_staging_folder_is_swept(tmp_path: Path) -> None:
    gone = tmp_path / f"{PREFIX}999999999-abc"  # above any pid_max: that worker is gone
    alive = tmp_path / f"{PREFIX}{os.getpid()}-abc"
    for folder in (gone, alive):
        folder.mkdir()
        (folder / "repl_main.pyc").write_bytes(b"x")
    sweep_staged(tmp_path)
    assert not gone.exists() and alive.exists()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_the_compile_runs_in_a_jail_like_a_cell(traversable_dir: Path) -> None:
    """It ran the configured interpreter on the host: with a planted one, that was code of the
    sandbox's choosing outside bwrap. The spy answers with what it could see, as its "bytecode"."""
    spy = traversable_dir / "python3"
    spy.write_text(
        "#!/bin/sh\nprintf 'sixteen-byte-hdr'\n"
        "if [ -e /etc/passwd ]; then echo host-files; else echo no-host-files; fi\n"
        "if [ -e /run ] || [ -e /home ] || [ -e /root ]; then echo host-root; else echo jail-root; fi\n"
    )
    spy.chmod(0o755)
    provider = LocalSandboxProvider(LocalSandboxConfig(), caps=Caps(), workspaces=traversable_dir)
    bwrap = shutil.which("bwrap")
    try:
        staged = provider._staged_driver(Isolation(bwrap=bwrap, python=str(spy)))
        assert staged.read_bytes() == b"sixteen-byte-hdrno-host-files\njail-root\n"
    finally:
        provider.close()
