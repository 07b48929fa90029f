"""`fleet program list|show|add|activate|rollback`: the program versions in the database (what
`PUT /api/programs/active` does over HTTP, for an operator on a host that reaches the database)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Mapping
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncSession

from fleet_shared.config import load_settings
from fleet_shared.db import programs
from fleet_shared.db.engine import create_engine, session_factory
from fleet_shared.db.models import ProgramVersion
from fleet_shared.program_text import MAX_INSTRUCTIONS_CHARS


def add_parser(command: argparse.ArgumentParser) -> None:
    actions = command.add_subparsers(dest="program_command", required=True)
    actions.add_parser("list", help="every version: id, status, who made it, validation scores")
    show = actions.add_parser("show", help="one version's text and details")
    show.add_argument("id")
    add = actions.add_parser("add", help="store a candidate from a text file (never active)")
    add.add_argument("file", type=Path)
    add.add_argument("--notes")
    activate = actions.add_parser(
        "activate", help="make a version active: Runs that start from now on run it"
    )
    activate.add_argument("id")
    actions.add_parser("rollback", help="make the version active before the current one active again")


def run_program_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    settings = load_settings(environ, lm_credentials=False)
    return asyncio.run(dispatch(args, settings.database_url))


async def dispatch(args: argparse.Namespace, database_url: str) -> int:
    engine = create_engine(database_url)
    try:
        async with session_factory(engine)() as db:
            return await act(db, args)
    finally:
        await engine.dispose()


async def act(db: AsyncSession, args: argparse.Namespace) -> int:
    action = args.program_command
    if action == "list":
        for version in await programs.list_versions(db):
            print(line(version))
        return 0
    if action == "show":
        shown = await programs.get_version(db, args.id)
        if shown is None:
            return missing(args.id)
        print(f"{line(shown)}\n\n{shown.text}")
        return 0
    if action == "add":
        text = args.file.read_text(encoding="utf-8").strip()
        if not text or len(text) > MAX_INSTRUCTIONS_CHARS:
            print(f"fleet: {args.file}: 1 to {MAX_INSTRUCTIONS_CHARS} characters", file=sys.stderr)
            return 2
        active = await programs.active_version(db)
        parent = active.id if active else None
        added = await programs.add_candidate(
            db, text, created_by="fleet program add", parent_id=parent, notes=args.notes
        )
        await db.commit()
        print(f"candidate {added.id} (activate it with `fleet program activate {added.id}`)")
        return 0
    wanted = args.id if action == "activate" else None
    if wanted is None:
        previous = await programs.previous_version(db)
        if previous is None:
            print("fleet: no version was active before the current one", file=sys.stderr)
            return 1
        wanted = previous.id
    activated = await programs.activate_on(db, wanted, rollback=action == "rollback")
    if activated is None:
        return missing(wanted)
    await db.commit()
    print(f"active: {activated.id} (Runs that start from now on run it)")
    return 0


def line(version: ProgramVersion) -> str:
    scores = ""
    if version.validation:
        v = version.validation
        scores = f"  validation {v.get('score')} vs active {v.get('active_score')} on {v.get('rows')} rows"
    made = f"{version.created_at:%Y-%m-%d %H:%M}  {version.created_by}"
    return f"{version.id}  {version.status:<9}  {made}{scores}"


def missing(version_id: str) -> int:
    print(f"fleet: no program version {version_id}", file=sys.stderr)
    return 1
