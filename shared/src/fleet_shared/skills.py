"""Skill cards: reading them from `config/skills/<id>.md`, seeding them into the DB, and the
`data-skill` part that tells the worker which skills a Turn selected.

A card is a TOML front matter block between two `+++` lines (`name`, `version`, `description`)
followed by its Markdown body; the file's stem is its id.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import msgspec
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_shared.config import describe_validation_error
from fleet_shared.db.engine import create_engine, session_factory
from fleet_shared.db.models import Skill, utcnow
from fleet_shared.errors import SkillCardError

SKILL_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
FENCE = "+++"
MAX_BODY_BYTES = 64 * 1024
FRONT_MATTER_KEYS = ("name", "version", "description")
CARD_SUFFIX = ".md"


class FrontMatter(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    version: Annotated[str, msgspec.Meta(min_length=1, max_length=100)]
    description: Annotated[str, msgspec.Meta(min_length=1, max_length=1000)]


class SkillCard(msgspec.Struct, frozen=True, kw_only=True):
    """One card as read from its file; `digest` is the sha256 of the file's bytes."""

    id: str
    name: str
    version: str
    description: str
    body: str
    digest: str


class SkillSync(msgspec.Struct, frozen=True, kw_only=True):
    """What a sync did, by id. Rows without a file are neither listed nor touched."""

    inserted: list[str]
    updated: list[str]
    unchanged: list[str]


# --- reading cards ----------------------------------------------------------------------------


def parse_skill_card(path: Path, raw: bytes) -> SkillCard:
    """The card in `raw` (the bytes of `path`); SkillCardError names the file and the key."""
    skill_id = path.name.removesuffix(CARD_SUFFIX)
    if not SKILL_ID.fullmatch(skill_id):
        raise SkillCardError(
            f"{path}: bad id {skill_id!r}: a card's file name must be <id>.md, "
            "the id 1-64 of a-z, 0-9 and '-', not starting with '-'"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SkillCardError(f"{path}: not UTF-8 text") from None
    table, body = split_front_matter(path, text)
    front = front_matter(path, table)
    if len(body.encode("utf-8")) > MAX_BODY_BYTES:
        raise SkillCardError(f"{path}: body: over {MAX_BODY_BYTES // 1024} KiB")
    if not body:
        raise SkillCardError(f"{path}: body: empty (write the card's guidance after the closing +++)")
    return SkillCard(
        id=skill_id,
        name=front.name.strip(),
        version=front.version.strip(),
        description=front.description.strip(),
        body=body,
        digest=hashlib.sha256(raw).hexdigest(),
    )


def split_front_matter(path: Path, text: str) -> tuple[dict[str, Any], str]:
    """The front matter's TOML table and the Markdown body after it."""
    lines = text.removeprefix("\ufeff").splitlines(keepends=True)
    if not lines or lines[0].strip() != FENCE:
        raise SkillCardError(f"{path}: the first line must be {FENCE} (the front matter's start)")
    closing = next((i for i, line in enumerate(lines[1:], 1) if line.strip() == FENCE), None)
    if closing is None:
        raise SkillCardError(f"{path}: the front matter has no closing {FENCE} line")
    try:
        table = tomllib.loads("".join(lines[1:closing]))
    except tomllib.TOMLDecodeError as exc:
        raise SkillCardError(f"{path}: front matter: invalid TOML: {exc}") from None
    return table, "".join(lines[closing + 1 :]).strip()


def front_matter(path: Path, table: dict[str, Any]) -> FrontMatter:
    missing = [key for key in FRONT_MATTER_KEYS if key not in table]
    if missing:
        raise SkillCardError(f"{path}: front matter: missing key {missing[0]!r}")
    unknown = sorted(set(table) - set(FRONT_MATTER_KEYS))
    if unknown:
        known = ", ".join(FRONT_MATTER_KEYS)
        raise SkillCardError(f"{path}: front matter: unknown key {unknown[0]!r} (known: {known})")
    if not isinstance(table["version"], str):
        kind = type(table["version"]).__name__
        raise SkillCardError(f'{path}: front matter: version must be a string (version = "1.0"), not {kind}')
    try:
        front = msgspec.convert(table, FrontMatter)
    except msgspec.ValidationError as exc:
        raise SkillCardError(f"{path}: front matter: {describe_validation_error(exc, '')}") from None
    for key in FRONT_MATTER_KEYS:
        if not getattr(front, key).strip():
            raise SkillCardError(f"{path}: front matter: {key} is blank")
    if any(c in front.description for c in "\r\n"):
        raise SkillCardError(f"{path}: front matter: description must be one line")
    return front


def load_skill_cards(folder: Path) -> list[SkillCard]:
    """Every `<id>.md` card in `folder`, sorted by id; a missing folder has none."""
    if not folder.is_dir():
        return []
    cards = [
        parse_skill_card(path, path.read_bytes())
        for path in folder.iterdir()
        # Hidden files are an editor's or the OS's, never a card.
        if path.suffix == CARD_SUFFIX and not path.name.startswith(".") and path.is_file()
    ]
    return sorted(cards, key=lambda card: card.id)


# --- seeding the DB ---------------------------------------------------------------------------


async def sync_skills(db: AsyncSession, cards: Sequence[SkillCard]) -> SkillSync:
    """Upsert the cards by id in one transaction: new ids are inserted, rows whose digest
    changed are rewritten. Rows with no card any more stay (still selectable)."""
    try:
        return await write_cards(db, cards)
    except IntegrityError:
        # Another seeder inserted one of the ids meanwhile: look again, and it is an update.
        await db.rollback()
        return await write_cards(db, cards)


async def write_cards(db: AsyncSession, cards: Sequence[SkillCard]) -> SkillSync:
    ids = [card.id for card in cards]
    rows = (await db.scalars(select(Skill).where(Skill.id.in_(ids)))).all() if ids else []
    existing = {row.id: row for row in rows}
    inserted, updated, unchanged = [], [], []
    stamp = utcnow()
    for card in cards:
        row = existing.get(card.id)
        if row is None:
            db.add(Skill(**msgspec.structs.asdict(card), created_at=stamp, updated_at=stamp))
            inserted.append(card.id)
        elif row.digest != card.digest:
            for field in ("name", "version", "description", "body", "digest"):
                setattr(row, field, getattr(card, field))
            row.updated_at = stamp
            updated.append(card.id)
        else:
            unchanged.append(card.id)
    await db.commit()
    return SkillSync(inserted=inserted, updated=updated, unchanged=unchanged)


def seed_skills(database_url: str, folder: Path) -> SkillSync:
    """The cards of `folder` into the DB at `database_url`, for synchronous callers (`fleet db
    upgrade`, `fleet up`, test fixtures). Every card is read before the DB is touched, so a bad
    card changes nothing."""
    cards = load_skill_cards(folder)

    async def run() -> SkillSync:
        engine = create_engine(database_url)
        try:
            async with session_factory(engine)() as db:
                return await sync_skills(db, cards)
        finally:
            await engine.dispose()

    return asyncio.run(run())


# --- the selection on the user's Turn (the interface to the worker) ---------------------------


class SelectedSkill(msgspec.Struct, frozen=True, kw_only=True):
    skill_id: str
    name: str
    version: str


def selected_skill_part(skill: Skill) -> dict[str, Any]:
    """A skill the Turn selected, as a part of the user's Turn; the worker takes it up from there
    (and announces it `activated`, then `loaded`)."""
    data = {"skill_id": skill.id, "name": skill.name, "version": skill.version, "phase": "selected"}
    return {"type": "data-skill", "data": data}


def selected_skills(parts: Sequence[dict[str, Any]]) -> list[SelectedSkill]:
    """The skills a user's Turn selected, in the order selected (read from its parts)."""
    selected = []
    for part in parts:
        data = part.get("data")
        if part.get("type") == "data-skill" and isinstance(data, dict) and data.get("phase") == "selected":
            selected.append(
                SelectedSkill(skill_id=data["skill_id"], name=data["name"], version=data["version"])
            )
    return selected
