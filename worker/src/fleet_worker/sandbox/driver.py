"""The REPL driver (repl_main.py) staged where every sandbox uid can read it, compiled ahead by
the sandbox's own interpreter so that no REPL start spends time compiling it (ADR 0018).

- The compile runs in a jail like a cell's (bwrap: no network, nothing of the host but the
  system and the interpreter, read-only), as a sandbox uid on a root worker. Unisolated (no
  bwrap) it runs with no privilege only (setpriv, no new privileges). It reads the source on
  stdin and writes the .pyc bytes to stdout; the worker writes the file.
- A .pyc loads only in the Python that wrote it: the interpreter's identity (path, size, mtime)
  is kept with the staged copy, and a changed interpreter (an upgrade) gets it staged anew.
- Anything that goes wrong stages the source instead; staging that cannot happen at all is
  SandboxUnavailable (the worker says why at startup).
- Each staging folder is named after its worker's pid, so a worker that died without its
  close() leaves nothing for long: the next worker on the host removes it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from fleet_worker.sandbox.errors import SandboxUnavailable
from fleet_worker.sandbox.jail import DRIVER_SOURCE, driver_mount
from fleet_worker.sandbox.process import SETPRIV

log = structlog.get_logger(__name__)
PREFIX = "fleet-repl-"
COMPILE_TIMEOUT_SECONDS = 30.0
PYC_HEADER_BYTES = 16  # magic, flags, and two words a .pyc run as a script does not check
# Run by the sandbox's interpreter under -I -S: source on stdin, the .pyc's bytes on stdout.
# Flags 0 and zero source stamps: nothing compares this .pyc with a source file.
COMPILE_DRIVER = (
    "import importlib.util, marshal, sys; "
    "code = compile(sys.stdin.buffer.read(), sys.argv[1], 'exec', dont_inherit=True); "
    "sys.stdout.buffer.write(importlib.util.MAGIC_NUMBER + bytes(12) + marshal.dumps(code))"
)


@dataclass(frozen=True)
class StagedDriver:
    path: Path
    isolated: bool  # staged for a jail (bwrap), or for plain subprocesses
    interpreter: tuple[str, int, int]  # what compiled it: realpath, size, mtime (ns)

    def current(self, python: str, isolated: bool) -> bool:
        return self.isolated == isolated and self.path.exists() and self.interpreter == identity(python)


def identity(python: str) -> tuple[str, int, int]:
    real = os.path.realpath(python)
    try:
        stat = os.stat(real)
    except OSError:
        return real, -1, -1
    return real, stat.st_size, stat.st_mtime_ns


def stage_driver(
    python: str, isolated: bool, compile_as: int | None, jail: Sequence[str] = ()
) -> StagedDriver:
    """Stage the driver for REPLs run by `python`, jailed or not; `compile_as` is the uid the
    compile drops to (None: run it as this process, which then is not root), `jail` the argv
    that runs the interpreter in a jail (empty: unisolated)."""
    try:
        directory = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
        directory.chmod(0o755)
        compiled = directory / "repl_main.pyc"
        # The name its frames carry must be the path the REPL runs it as (DRIVER_FILE hides them).
        seen_as = driver_mount(compiled) if isolated else str(compiled)
        pyc = compiled_driver(python, seen_as, compile_as, jail)
        if pyc is not None:
            compiled.write_bytes(pyc)
            target = compiled
        else:
            target = directory / "repl_main.py"
            shutil.copyfile(DRIVER_SOURCE, target)
        target.chmod(0o444)
    except OSError as exc:
        raise SandboxUnavailable(
            f"the REPL driver cannot be staged in {tempfile.gettempdir()}: {exc}",
            fix="give the worker a writable temporary folder (TMPDIR)",
        ) from exc
    return StagedDriver(target, isolated, identity(python))


def compiled_driver(
    python: str, seen_as: str, compile_as: int | None, jail: Sequence[str] = ()
) -> bytes | None:
    """The driver compiled by `python` into .pyc bytes, or None (logged) if that failed."""
    compile_args = ["-I", "-S", "-c", COMPILE_DRIVER, seen_as]
    argv = [*jail, *compile_args] if jail else [python, *compile_args]
    if compile_as is not None and not jail:
        drop = [f"--reuid={compile_as}", f"--regid={compile_as}", "--clear-groups", "--no-new-privs"]
        argv = [SETPRIV, *drop, "--", *argv]
    as_uid = compile_as if jail else None  # a jail is entered as that uid (no setpriv inside it)
    try:
        done = subprocess.run(
            argv,
            user=as_uid,
            group=as_uid,
            extra_groups=[] if as_uid is not None else None,
            input=DRIVER_SOURCE.read_bytes(),
            env={"PATH": "/usr/bin:/bin"},
            cwd="/",
            capture_output=True,
            timeout=COMPILE_TIMEOUT_SECONDS,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("sandbox.driver_not_compiled", python=python, error=str(exc))
        return None
    if len(done.stdout) <= PYC_HEADER_BYTES:
        log.warning("sandbox.driver_not_compiled", python=python, error="no bytecode came back")
        return None
    return done.stdout


def sweep_staged(root: Path | None = None) -> None:
    """Remove staging folders whose worker is gone (it died before its close())."""
    for folder in (root or Path(tempfile.gettempdir())).glob(f"{PREFIX}*-*"):
        owner = folder.name[len(PREFIX) :].split("-", 1)[0]
        try:
            ours = not folder.is_symlink() and folder.is_dir() and folder.stat().st_uid == os.geteuid()
        except OSError:
            continue
        if ours and owner.isdigit() and not Path(f"/proc/{owner}").exists():
            shutil.rmtree(folder, ignore_errors=True)
