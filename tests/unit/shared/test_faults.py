"""Which errors mean "the database is unreachable" (retry, or 503) and which mean a bad query."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import (
    DataError,
    DBAPIError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    ProgrammingError,
)

from fleet_shared.db.faults import is_unreachable


class FakePgError(Exception):
    """asyncpg's errors carry a SQLSTATE."""

    def __init__(self, sqlstate: str) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


@pytest.mark.parametrize(
    "error",
    [
        OperationalError("SELECT 1", None, Exception("connection refused")),
        InterfaceError("SELECT 1", None, Exception("connection closed")),
        ConnectionRefusedError(111, "refused"),
        TimeoutError(),
        DBAPIError("SELECT 1", None, FakePgError("57P01")),  # admin shutdown
        DBAPIError("SELECT 1", None, FakePgError("57P03")),  # the server is starting up
        DBAPIError("SELECT 1", None, FakePgError("08006")),  # connection failure
        DBAPIError("SELECT 1", None, Exception("x"), connection_invalidated=True),
    ],
)
def test_unreachable(error: BaseException) -> None:
    assert is_unreachable(error)


@pytest.mark.parametrize(
    "error",
    [
        IntegrityError("INSERT", None, FakePgError("23505")),
        DataError("SELECT", None, FakePgError("22P02")),
        ProgrammingError("SELECT", None, FakePgError("42P01")),
        ValueError("no"),
    ],
)
def test_not_unreachable(error: BaseException) -> None:
    assert not is_unreachable(error)


def test_a_wrapped_cause_counts() -> None:
    try:
        try:
            raise ConnectionResetError("reset")
        except ConnectionResetError as inner:
            raise RuntimeError("while committing") from inner
    except RuntimeError as outer:
        assert is_unreachable(outer)
