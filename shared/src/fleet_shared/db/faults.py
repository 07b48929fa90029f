"""Which database errors mean "the database cannot take this right now" (retry, or answer 503)."""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

# SQLSTATE classes: 08 connection exception; 57P01-57P03 admin or crash shutdown, cannot connect
# now (a server starting or stopping); 53300 too many connections; 25006 a read-only transaction
# (a failover in progress: the old primary went read-only); 40001 / 40P01 a serialization
# failure or deadlock (the same write succeeds when tried again).
UNREACHABLE_SQLSTATES = ("08", "57P01", "57P02", "57P03", "53300", "25006", "40001", "40P01")


def is_unreachable(exc: BaseException) -> bool:
    """True when `exc` (or what it wraps) says the database is unreachable, not that a query is bad.

    SQLite reports a busy or missing file as OperationalError; PostgreSQL through asyncpg may
    surface a refused connection as a bare OSError, or a shutdown as a DBAPIError with a SQLSTATE.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OperationalError | InterfaceError | PoolTimeout | OSError | TimeoutError):
            return True
        if isinstance(current, DBAPIError) and current.connection_invalidated:
            return True
        sqlstate = getattr(current, "sqlstate", None) or getattr(current, "pgcode", None)
        if isinstance(sqlstate, str) and sqlstate.startswith(UNREACHABLE_SQLSTATES):
            return True
        current = getattr(current, "orig", None) or current.__cause__ or current.__context__
    return False
