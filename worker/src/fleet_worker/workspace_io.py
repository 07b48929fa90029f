"""Files across the sandbox boundary: attachments in before the program, artifacts out after.

Attachments are copied from the blob store into `/workspace/attachments/` and announced with
`data-attachment`. Artifacts are the regular files under `/workspace/artifacts/` that a Run
created or changed: at settlement each is copied out (no link followed, size-capped, hashed on
the way), stored as `artifacts/<id>` in the blob store and announced with `data-artifact`; the
rows are written by the same commit as the Turn (from those events). What comes out of a
sandbox is hostile: names are workspace-relative and checked, sizes are capped while copying.
"""

from __future__ import annotations

import hashlib
import mimetypes
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

import structlog

from fleet_shared.blobs import BlobMissing, BlobStore
from fleet_shared.events import ArtifactCreated, AttachmentStaged, SkillUsed, Warning
from fleet_shared.ids import new_id
from fleet_worker.conversation import AttachmentRef, SkillRef
from fleet_worker.errors import TurnFailed
from fleet_worker.publisher import EventSink
from fleet_worker.sandbox.provider import FileStamp, SandboxLease

log = structlog.get_logger(__name__)
ARTIFACTS = "artifacts"
ATTACHMENTS = "attachments"
SKILLS = "skills"
SKILL_PROMPT_CHARS = 8000  # of a card's body given inline; the whole card is in skills/
MAX_NAME_CHARS = 1024


@dataclass(frozen=True)
class ArtifactLimits:
    max_count: int
    max_bytes: int


class HashingSink:
    """A file that hashes what is written to it."""

    def __init__(self, target: IO[bytes]) -> None:
        self.target = target
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        return self.target.write(data)


def staged_names(attachments: list[AttachmentRef]) -> list[str]:
    """One name per attachment in `attachments/`, unique (a second `a.txt` becomes `a (2).txt`)."""
    used: set[str] = set()
    names = []
    for attachment in attachments:
        stem, dot, suffix = attachment.filename.rpartition(".")
        if not stem:
            stem, dot, suffix = attachment.filename, "", ""
        name, counter = attachment.filename, 1
        while name in used:
            counter += 1
            name = f"{stem} ({counter}){dot}{suffix}"
        used.add(name)
        names.append(name)
    return names


def stage_attachments(
    blobs: BlobStore, lease: SandboxLease, attachments: list[AttachmentRef], sink: EventSink
) -> list[str]:
    """Copy each attachment into the workspace (blocking); how the RLM is told about them."""
    described = []
    for attachment, name in zip(attachments, staged_names(attachments), strict=True):
        with tempfile.NamedTemporaryFile(prefix="fleet-attachment-") as copy:
            try:
                blobs.download(f"attachments/{attachment.id}", copy)
            except BlobMissing:
                raise TurnFailed(
                    f"the bytes of attachment {attachment.id} are missing from storage; upload it again",
                    code="attachment_unavailable",
                ) from None
            copy.flush()
            put_or_fail(
                lease,
                f"{ATTACHMENTS}/{name}",
                Path(copy.name),
                f"attachment {attachment.id}",
                "attachment_unavailable",
            )
        sink.emit_threadsafe(
            AttachmentStaged(
                run_id=sink.sequencer.run_id,
                attachment_id=attachment.id,
                filename=name,
                byte_size=attachment.byte_size,
            )
        )
        described.append(
            f"/workspace/{ATTACHMENTS}/{name} ({attachment.media_type}, {attachment.byte_size} bytes)"
        )
    return described


def put_or_fail(lease: SandboxLease, relative: str, source: Path, what: str, code: str) -> None:
    """Copy a staged file into the workspace, or fail the Turn with `code` saying what is in the way."""
    try:
        lease.files.put(relative, source)
    except OSError:
        raise TurnFailed(
            f"{what} could not be written to {relative}: something of that name is in the way in the "
            "workspace (a folder?); remove it and send again",
            code=code,
        ) from None


def stage_skills(lease: SandboxLease, skills: list[SkillRef], sink: EventSink) -> list[str]:
    """Write each selected skill card to skills/<id>.md (blocking), announcing it `activated`
    then `loaded`; the cards as the RLM is given them."""
    given = []
    run_id = sink.sequencer.run_id
    for skill in skills:
        sink.emit_threadsafe(skill_event(run_id, skill, "activated"))
        card = f"# {skill.name} (version {skill.version})\n\n{skill.description}\n\n{skill.body}"
        with tempfile.NamedTemporaryFile(prefix="fleet-skill-", mode="w", encoding="utf-8") as copy:
            copy.write(card)
            copy.flush()
            put_or_fail(
                lease, f"{SKILLS}/{skill.id}.md", Path(copy.name), f"skill {skill.id}", "skill_unavailable"
            )
        sink.emit_threadsafe(skill_event(run_id, skill, "loaded"))
        body = skill.body
        if len(body) > SKILL_PROMPT_CHARS:
            body = body[:SKILL_PROMPT_CHARS] + f"\n[... the rest is in /workspace/{SKILLS}/{skill.id}.md]"
        given.append(
            f"{skill.name} (version {skill.version}, /workspace/{SKILLS}/{skill.id}.md): "
            f"{skill.description}\n\n{body}"
        )
    return given


def skill_event(run_id: str, skill: SkillRef, phase: Literal["activated", "loaded"]) -> SkillUsed:
    return SkillUsed(run_id=run_id, skill_id=skill.id, name=skill.name, version=skill.version, phase=phase)


def stamp_limit(max_count: int) -> int:
    """How many files of artifacts/ are looked at: enough to see past a few thousand old ones."""
    return 10 * max_count + 1000


def changed_files(before: dict[str, FileStamp], after: dict[str, FileStamp]) -> list[str]:
    """Files that are new or different since the Run began, in name order."""
    return sorted(name for name, stamp in after.items() if before.get(name) != stamp)


def collect_artifacts(
    blobs: BlobStore,
    lease: SandboxLease,
    before: dict[str, FileStamp],
    limits: ArtifactLimits,
    sink: EventSink,
) -> None:
    """Store what the Run wrote under `artifacts/` and announce each file (blocking)."""
    run_id = sink.sequencer.run_id
    after = lease.files.stamps(ARTIFACTS, stamp_limit(limits.max_count) + len(before))
    names = [n for n in changed_files(before, after) if len(n) <= MAX_NAME_CHARS]
    if len(names) > limits.max_count:
        message = (
            f"the Run wrote {len(names)} files under artifacts/; only the first {limits.max_count} "
            "were kept (storage.max_artifacts_per_run)"
        )
        sink.emit_threadsafe(Warning(run_id=run_id, code="artifacts_truncated", message=message))
        names = names[: limits.max_count]
    for name in names:
        try:
            sink.emit_threadsafe(store_one(blobs, lease, name, limits.max_bytes, run_id))
        except FileNotFoundError:
            continue  # removed (or swapped for a link) since it was seen: nothing to keep
        except ValueError:
            message = (
                f"artifacts/{name} was not kept: larger than {limits.max_bytes} bytes "
                "(storage.max_artifact_mb)"
            )
            sink.emit_threadsafe(Warning(run_id=run_id, code="artifact_too_large", message=message))


def store_one(
    blobs: BlobStore, lease: SandboxLease, name: str, max_bytes: int, run_id: str
) -> ArtifactCreated:
    """Copy one file out (hashing it), store it; FileNotFoundError if it is gone or not a
    regular file, ValueError if it is larger than `max_bytes`."""
    artifact_id = new_id()
    with tempfile.NamedTemporaryFile(prefix="fleet-artifact-") as copy:
        hashing = HashingSink(copy)
        size = lease.files.export(f"{ARTIFACTS}/{name}", hashing, max_bytes)
        copy.flush()
        blobs.put_file(f"artifacts/{artifact_id}", Path(copy.name))
    media_type = mimetypes.guess_type(name, strict=False)[0] or "application/octet-stream"
    return ArtifactCreated(
        run_id=run_id,
        artifact_id=artifact_id,
        name=name,
        media_type=media_type,
        byte_size=size,
        checksum_sha256=hashing.sha256.hexdigest(),
    )
