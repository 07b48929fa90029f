"""A Turn's request and the session's earlier Turns as dspy.History, bounded by policy.

Only the last `rlm.max_history_turns` answered Turns, and at most `rlm.max_history_chars` of their
text, reach the RLM: a long session can never outgrow a prompt or the sandbox's frame.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session as OrmSession

from fleet_shared.db import files, queries, skills
from fleet_shared.db.engine import run_whole
from fleet_shared.db.models import Attachment, Skill, Turn
from fleet_shared.skills import SelectedSkill, selected_skills
from fleet_worker.errors import TurnFailed

CUT_MARK = "\n[... cut]"


@dataclass(frozen=True)
class AttachmentRef:
    id: str
    filename: str
    media_type: str
    byte_size: int


@dataclass(frozen=True)
class SkillRef:
    id: str
    name: str
    version: str
    description: str
    body: str


@dataclass(frozen=True)
class Conversation:
    request: str
    history: list[dict[str, str]]
    truncated: bool  # older Turns, or parts of them, were left out
    attachments: list[AttachmentRef] = field(default_factory=list)  # sent with this Turn
    skills: list[SkillRef] = field(default_factory=list)  # selected for this Turn


async def load_conversation(
    db_sessions: async_sessionmaker[AsyncSession],
    session_id: str,
    user_sequence: int,
    *,
    max_turns: int,
    max_chars: int,
) -> Conversation:
    # Two rows (request, answer) per earlier Turn, plus this Turn's request; one more for a
    # request whose answer failed (it is skipped, not counted).
    first = max(0, user_sequence - 2 * max_turns - 2)

    def read(db: OrmSession) -> tuple[Sequence[Turn], list[Attachment], list[SelectedSkill], list[Skill]]:
        turns = queries.list_turns_on(db, session_id, after_sequence=first, limit=user_sequence - first)
        sent = next((t.parts for t in turns if t.sequence == user_sequence), [])
        selection = selected_skills(sent)
        cards = skills.get_skills_on(db, [s.skill_id for s in selection])
        return turns, files.get_attachments_on(db, attachment_ids(sent)), selection, cards

    # One hop on SQLite (fleet_shared.db.engine.run_whole): the history is on every Turn's path.
    turns, rows, selection, cards = await run_whole(db_sessions, read)
    attachments = [AttachmentRef(r.id, r.filename, r.media_type, r.byte_size) for r in rows]
    chosen = [SkillRef(c.id, c.name, c.version, c.description, c.body) for c in cards]
    stale = changed_skills(selection, chosen)
    if stale:  # the card was re-seeded since the Turn was checked: not what the user chose
        raise TurnFailed(
            f"skill {stale} changed since the Turn was sent; send it again to use the new version",
            code="skill_unavailable",
        )
    texts = {t.sequence: (t.role, t.status, text_of(t.parts)) for t in turns}
    request = texts[user_sequence][2]
    pairs = [
        {"request": text, "answer": texts[seq + 1][2]}
        for seq, (role, _status, text) in sorted(texts.items())
        if role == "user"
        and seq < user_sequence
        and texts.get(seq + 1, ("", "", ""))[:2] == ("assistant", "completed")
    ]
    history, cut = bounded(pairs[-max_turns:] if max_turns else [], max_chars)
    earlier = first > 0 or len(pairs) > max_turns
    truncated = cut or (earlier and bool(pairs))
    return Conversation(request, history, truncated=truncated, attachments=attachments, skills=chosen)


def changed_skills(selection: list[SelectedSkill], cards: list[SkillRef]) -> str | None:
    """The first selected skill that is gone, or whose version is not the one selected."""
    found = {card.id: card.version for card in cards}
    for chosen in selection:
        if found.get(chosen.skill_id) != chosen.version:
            return repr(chosen.skill_id)
    return None


def bounded(pairs: list[dict[str, str]], max_chars: int) -> tuple[list[dict[str, str]], bool]:
    """The newest pairs that fit in `max_chars`; the oldest one kept may be cut to fit."""
    kept: list[dict[str, str]] = []
    room = max_chars
    for pair in reversed(pairs):
        size = len(pair["request"]) + len(pair["answer"])
        if size <= room:
            kept.append(pair)
            room -= size
            continue
        if room > 2 * len(CUT_MARK):
            half = room // 2 - len(CUT_MARK)
            kept.append({key: cut(value, half) for key, value in pair.items()})
        kept.reverse()
        return kept, True
    kept.reverse()
    return kept, False


def cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + CUT_MARK


def text_of(parts: list[dict[str, Any]]) -> str:
    return "".join(str(p.get("text", "")) for p in parts if p.get("type") == "text")


def attachment_ids(parts: list[dict[str, Any]]) -> list[str]:
    return [
        str(p["data"]["attachment_id"])
        for p in parts
        if p.get("type") == "data-attachment" and isinstance(p.get("data"), dict)
    ]
