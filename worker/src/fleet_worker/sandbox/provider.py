"""What a Turn needs from a sandbox, whoever provides it: the only sandbox types `turn.py` knows.

A `SandboxProvider` leases a session's workspace to one Run (`acquire`). The lease hands out
fresh REPLs (`interpreter_factory`, wrapped by the dspy adapter into dspy's CodeInterpreter),
kills a running cell (`interrupt`), moves files between the host and the workspace (`files`),
and is given back at the end (`release`, or `retire` when it must not be reused).

Two providers implement it: `local` (bubblewrap on this machine, `sandbox/local.py`) and
`daytona` (one Daytona sandbox per session, `sandbox/daytona/`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fleet_shared.manifests import Manifest
from fleet_worker.sandbox.boundary import CellResult


class Repl(Protocol):
    """One persistent REPL: cells share state until it is killed (timeout, crash, interrupt)."""

    def start(self) -> None: ...

    def execute(
        self,
        code: str,
        variables: Mapping[str, Any],
        tools: Mapping[str, Callable[..., Any]],
        output_fields: Sequence[str] | None,
    ) -> CellResult: ...

    def interrupt(self) -> None: ...

    def shutdown(self) -> None: ...


# Why storing this many bytes more would pass a quota, or None (fleet_shared.db.files).
Room = Callable[[int], "str | None"]


def no_quota(_size: int) -> str | None:
    return None


class OverQuota(Exception):
    """Storing the files a Run changed would pass a quota (the message says which)."""


@dataclass(frozen=True)
class Captured:
    """A workspace as its Run left it: its next version's manifest, what storing the files the
    Run changed added to the store, and what the provider keeps to tell a later change."""

    manifest: Manifest
    added_bytes: int
    known: Any = None


@dataclass(frozen=True)
class FileStamp:
    """Enough to tell whether a workspace file changed during a Run."""

    size: int
    mtime_ns: int


class Writable(Protocol):
    def write(self, data: bytes, /) -> int: ...


class WorkspaceFiles(Protocol):
    """The host's way into a leased workspace. Paths are relative to the workspace root; no
    symlink inside the workspace is ever followed, and only regular files are read."""

    def put(self, relative: str, source: Path) -> None:
        """Copy a host file into the workspace (replacing whatever is there), readable inside."""
        ...

    def stamps(self, folder: str, limit: int) -> dict[str, FileStamp]:
        """Regular files under `folder` (relative names, at most `limit` of them)."""
        ...

    def export(self, relative: str, sink: Writable, max_bytes: int) -> int:
        """Copy one regular file out into `sink`; its size. ValueError past `max_bytes`,
        FileNotFoundError when it is gone or is not a regular file."""
        ...


class SandboxLease(Protocol):
    @property
    def run_id(self) -> str: ...

    @property
    def files(self) -> WorkspaceFiles:
        """The leased workspace's files, seen from the host."""
        ...

    def interpreter_factory(self) -> Repl:
        """A fresh REPL for this Run (each dspy interpreter gets its own)."""
        ...

    def interrupt(self) -> None:
        """Kill whatever cell is running in this lease's REPLs (a stop or a timeout)."""
        ...

    def release(self) -> None:
        """Shut every REPL down and give the workspace back; idempotent, never raises."""
        ...

    def retire(self) -> None:
        """As release, and never reuse what backed this lease (it misbehaved)."""
        ...

    def capture(self, room: Room = no_quota, counted: frozenset[str] = frozenset()) -> Captured:
        """What the workspace holds now, as the manifest of its next version; every file the
        Run changed is put in the store first (blocking). OverQuota, with nothing stored, when
        `room` refuses what they add; the files in `counted` (workspace-relative paths) are
        counted elsewhere (the Run's artifacts) and left out of that."""
        ...


class SandboxProvider(Protocol):
    @property
    def mode(self) -> str:
        """One line for the startup log and /ready: what this worker's sandboxes are."""
        ...

    def check(self) -> None:
        """Fail (SandboxUnavailable) unless sandboxes can be made as configured."""
        ...

    def acquire(
        self, workspace_id: str, run_id: str, session_id: str = "", manifest: Manifest | None = None
    ) -> SandboxLease:
        """Lease the workspace `workspace_id` (its layout prepared) to the Run `run_id` of the
        session `session_id` (providers that keep a sandbox per session label it so), holding
        exactly the files of `manifest`, the version the Run starts from."""
        ...

    def acquire_scratch(self, run_id: str) -> SandboxLease:
        """A sandbox of its own with an empty, throwaway workspace (no session volume), for a
        child RLM of the Run `run_id`; its release removes it all."""
        ...

    def close(self) -> None:
        """The worker is stopping: free whatever is kept warm."""
        ...


class ScratchLease:
    """A lease whose release also throws away what backed it (a child RLM's sandbox)."""

    def __init__(self, inner: SandboxLease, discard: Callable[[], None]) -> None:
        self.inner = inner
        self.discard = discard
        self.released = False

    @property
    def run_id(self) -> str:
        return self.inner.run_id

    @property
    def files(self) -> WorkspaceFiles:
        return self.inner.files

    def interpreter_factory(self) -> Repl:
        return self.inner.interpreter_factory()

    def interrupt(self) -> None:
        self.inner.interrupt()

    def release(self) -> None:
        """Idempotent; may raise when the throwaway parts could not be removed (reported)."""
        if self.released:
            return
        self.released = True
        self.inner.retire()
        self.discard()

    def retire(self) -> None:
        self.release()

    def capture(self, room: Room = no_quota, counted: frozenset[str] = frozenset()) -> Captured:
        return self.inner.capture(room, counted)
