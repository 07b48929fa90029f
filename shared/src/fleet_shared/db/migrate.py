"""`fleet db upgrade` / `fleet db check`: Alembic driven programmatically, never at service startup."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config


def alembic_config(database_url: str, ini_path: Path | None = None) -> Config:
    ini = ini_path or find_alembic_ini()
    config = Config(str(ini))
    config.attributes["database_url"] = database_url
    return config


def find_alembic_ini() -> Path:
    """alembic.ini in the working directory, else next to the source checkout."""
    for candidate in (
        Path.cwd() / "alembic.ini",
        Path(__file__).resolve().parents[4] / "alembic.ini",
    ):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError("alembic.ini not found: run from the fleet checkout or image root")


def upgrade(database_url: str) -> None:
    command.upgrade(alembic_config(database_url), "head")
