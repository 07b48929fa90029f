"""Identifiers: UUID strings, plus the parsing that turns a bad path id into a clean 404."""

import uuid


def new_id() -> str:
    return str(uuid.uuid4())


def parse_uuid(value: str) -> str | None:
    """The canonical form of `value`, or None when it is not a UUID."""
    try:
        return str(uuid.UUID(value))
    except (ValueError, AttributeError, TypeError):
        return None
