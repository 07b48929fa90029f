"""The REPL driver is staged compiled by the sandbox's own interpreter, under the name the REPL
runs it as; an interpreter that cannot compile it gets the source instead."""

from __future__ import annotations

import marshal
import shutil
import sys
from pathlib import Path

import pytest

from fleet_worker.sandbox.jail import DRIVER_SOURCE, driver_mount
from fleet_worker.sandbox.local import stage_driver

PYTHON = sys.executable  # the pyc is read back below by this same interpreter


def code_of(pyc: Path) -> object:
    return marshal.loads(pyc.read_bytes()[16:])  # after the header: magic, flags, two words


@pytest.mark.parametrize("isolated", [True, False])
def test_the_driver_is_staged_compiled_under_the_name_it_runs_as(isolated: bool) -> None:
    staged = stage_driver(PYTHON, isolated)
    try:
        assert staged.suffix == ".pyc"
        assert staged.stat().st_mode & 0o777 == 0o444 and staged.parent.stat().st_mode & 0o777 == 0o755
        code = code_of(staged)
        seen_as = driver_mount(staged) if isolated else str(staged)
        assert getattr(code, "co_filename", None) == seen_as  # so its frames stay out of tracebacks
    finally:
        shutil.rmtree(staged.parent)


def test_an_interpreter_that_cannot_compile_gets_the_source(tmp_path: Path) -> None:
    broken = tmp_path / "python3"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    staged = stage_driver(str(broken), isolated=True)
    try:
        assert staged.name == "repl_main.py"
        assert staged.read_bytes() == DRIVER_SOURCE.read_bytes()
        assert not (staged.parent / "repl_main.pyc").exists()
    finally:
        shutil.rmtree(staged.parent)
