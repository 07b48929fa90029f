"""The revisions the code knows match Alembic's chain, and readiness reads a newer schema as
"ahead" (a rolling upgrade) rather than as one to migrate."""

from __future__ import annotations

from pathlib import Path

from alembic.config import Config
from alembic.script import ScriptDirectory

from fleet_shared.db.engine import HEAD_REVISION, REVISIONS, schema_state

REPO = Path(__file__).resolve().parents[3]


def alembic_chain() -> list[str]:
    scripts = ScriptDirectory.from_config(Config(str(REPO / "alembic.ini")))
    newest_first = [script.revision for script in scripts.walk_revisions()]
    return list(reversed(newest_first))


def test_known_revisions_are_alembics_chain_in_order() -> None:
    assert list(REVISIONS) == alembic_chain()
    assert alembic_chain()[-1] == HEAD_REVISION


def test_schema_state() -> None:
    assert schema_state(HEAD_REVISION) == "head"
    assert schema_state(REVISIONS[0]) == "behind"
    assert schema_state(None) == "missing"
    assert schema_state("9999_from_a_newer_release") == "ahead"
