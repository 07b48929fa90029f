"""What a settling Run keeps besides its Turn: the files it wrote under artifacts/, and its
workspace as the next version. Both are put in the blob store before the commit that refers to
them, so a committed row never names a missing object."""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING

import structlog

from fleet_shared.db.files import StorageQuota, quota_refusal, stored_bytes_on
from fleet_shared.db.workspace_versions import WorkspaceChange
from fleet_shared.events import ArtifactCreated, RunWarning
from fleet_shared.run_state import RunCommand
from fleet_worker.artifacts import ARTIFACTS, ArtifactLimits, collect_artifacts
from fleet_worker.outcome import Outcome
from fleet_worker.sandbox.provider import OverQuota
from fleet_worker.settlement import run_whole_with_retry

if TYPE_CHECKING:
    from fleet_worker.turn import HeldTurn, WorkerDeps

log = structlog.get_logger(__name__)


async def keep_artifacts(deps: WorkerDeps, turn: HeldTurn, outcome: Outcome, deadline: float) -> Outcome:
    """Store and announce what the Run wrote under artifacts/ (the commit records them). If the
    blob store (or the database, past the Turn's deadline) refuses, a completed Turn fails: its
    answer may refer to files it cannot have."""
    if turn.sandbox is None or turn.lease.lost.is_set():
        return outcome
    try:
        await collect_artifacts(
            db_sessions=deps.db_sessions,
            blobs=deps.blobs,
            executor=deps.sandbox_ops,
            lease=turn.sandbox,
            before=turn.artifacts_before,
            session_id=turn.claim.session_id,
            limits=ArtifactLimits.of(
                deps.settings.profile.storage, deps.settings.profile.quotas.of(turn.claim.tenant)
            ),
            sink=turn.sink,
            deadline=deadline,
        )
    except Exception as exc:
        log.warning("turn.artifacts_failed", error_type=type(exc).__name__, error=str(exc))
        if outcome.command is RunCommand.COMPLETE:
            message = "the files the Turn wrote under artifacts/ could not be stored; send it again"
            return Outcome(RunCommand.FAIL, "failed", failure_code="artifact_error", failure_message=message)
    return outcome


async def keep_workspace(
    deps: WorkerDeps, turn: HeldTurn, outcome: Outcome, deadline: float
) -> tuple[Outcome, WorkspaceChange | None]:
    """The workspace's next version, its changed files stored: whatever the Run's ending, what
    it wrote is what the session's next Turn finds. None when there is nothing to record (no
    sandbox, or the Run is no longer this worker's), and when storing the files it changed
    would pass a quota (a `data-warning` says so). If the store refuses, a completed Turn
    fails; either way the session's next Turn starts from the version this one started from."""
    workspace, sandbox = turn.claim.workspace, turn.sandbox
    if sandbox is None or workspace is None or turn.lease.lost.is_set():
        return outcome, None
    # The Run's artifacts are counted once, as artifacts, though their files stay in the
    # workspace too.
    artifacts = [e for e in turn.sink.events if isinstance(e, ArtifactCreated)]
    counted = frozenset(f"{ARTIFACTS}/{e.name}" for e in artifacts)
    loop = asyncio.get_running_loop()

    async def refusal(size: int) -> str | None:
        stored = await run_whole_with_retry(
            deps.db_sessions,
            functools.partial(stored_bytes_on, session_id=turn.claim.session_id),
            deadline=deadline,
            what="quota_read",
        )
        stored = stored.plus(sum(e.byte_size for e in artifacts))
        profile = deps.settings.profile
        return quota_refusal(
            StorageQuota.of(profile.storage, profile.quotas.of(turn.claim.tenant)), stored, size
        )

    def room(size: int) -> str | None:
        """Asked by the capture (on its thread) only when the Run changed files: the usage is
        read then, never for a Turn that stores nothing."""
        return asyncio.run_coroutine_threadsafe(refusal(size), loop).result()

    try:
        captured = await loop.run_in_executor(deps.sandbox_ops, sandbox.capture, room, counted)
    except OverQuota as exc:
        message = (
            f"the workspace's changes were not kept: {exc}; the next Turn starts from the last kept version"
        )
        turn.sink.emit(RunWarning(run_id=turn.claim.run_id, code="storage_quota_exceeded", message=message))
        return outcome, None
    except Exception as exc:
        log.warning("turn.workspace_failed", error_type=type(exc).__name__, error=str(exc))
        if outcome.command is RunCommand.COMPLETE:
            message = "the Turn's workspace could not be saved; send it again"
            outcome = Outcome(
                RunCommand.FAIL, "failed", failure_code="workspace_error", failure_message=message
            )
        return outcome, None
    sha256 = captured.manifest.sha256
    deps.manifests.put(sha256, captured.manifest)  # the next claim's, likely
    change = WorkspaceChange(
        workspace_id=workspace.workspace_id,
        seen_version=workspace.version,
        manifest=captured.manifest,
        added_bytes=captured.added_bytes,
        seen_manifest_sha256=workspace.manifest_sha256,
        manifest_sha256=sha256,
        versions_kept=deps.settings.profile.storage.workspace_versions_kept,
    )
    return outcome, change
