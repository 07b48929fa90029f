"""Files into the sandbox before the program: attachments and skill cards (artifacts come out
after it: fleet_worker.artifacts).

Attachments are copied from the blob store into `/workspace/attachments/` and announced with
`data-attachment`; the selected skills' cards are written to `/workspace/skills/`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

import structlog

from fleet_shared.blobs import BlobMissing, BlobStore, attachment_key
from fleet_shared.events import AttachmentStaged, SkillUsed
from fleet_worker.conversation import AttachmentRef, SkillRef
from fleet_worker.errors import TurnFailed
from fleet_worker.publisher import EventSink
from fleet_worker.sandbox.provider import SandboxLease

log = structlog.get_logger(__name__)
ATTACHMENTS = "attachments"
SKILLS = "skills"
SKILL_PROMPT_CHARS = 8000  # of a card's body given inline; the whole card is in skills/


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
                blobs.download(attachment_key(attachment.id), copy)
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
