"""Which database errors mean "the database cannot take this right now" (retry, or answer 503).

The rule is structural: any failure to open a connection, or to check one out of the pool, is an
outage, whatever the driver raised (a refusal's SQLSTATE, a socket error, a failed name lookup,
the driver's own client error). Only an error raised by a statement on an open connection can be
the query's fault, and among those the SQLSTATEs below still mean "try again".

`count_connect_failures_as_outages` makes an engine say which is which: every failure to connect
comes out as a SQLAlchemy error with `connection_invalidated` set, which `is_unreachable` counts.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.engine import Dialect, ExceptionContext
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

# SQLSTATEs of statements on an open connection that say "try again": 08 connection exception;
# 57P01/57P02 admin or crash shutdown (the session was ended); 25006 a read-only transaction (a
# failover in progress: the old primary went read-only); 40001 / 40P01 a serialization failure or
# deadlock (the same write succeeds when tried again).
UNREACHABLE_SQLSTATES = ("08", "57P01", "57P02", "25006", "40001", "40P01")


def is_unreachable(exc: BaseException) -> bool:
    """True when `exc` (or what it wraps) says the database is unreachable, not that a query is bad.

    A failure to connect on an engine of `count_connect_failures_as_outages` is a DBAPIError with
    `connection_invalidated`; so is a connection lost under a statement. SQLite reports a busy or
    missing file as OperationalError; a socket error may also surface bare (OSError).
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


def count_connect_failures_as_outages(engine: Engine) -> None:
    """Make every failure of `engine` to open a connection, or to check a pooled one out, a
    SQLAlchemy error with `connection_invalidated` set: what the caller learns is "the database
    took no query", never a driver's error that looks like the query's fault.

    Both hooks are SQLAlchemy's public events: `do_connect` wraps the driver's connect, and
    `handle_error` sees the DBAPI errors that SQLAlchemy raises while no Connection exists yet."""
    event.listen(engine, "do_connect", open_connection)
    event.listen(engine, "handle_error", mark_checkout_failure)


def open_connection(dialect: Dialect, _record: Any, cargs: list[Any], cparams: dict[str, Any]) -> Any:
    """The driver's connect, as SQLAlchemy makes it. Its DBAPI errors pass on for SQLAlchemy to
    wrap (mark_checkout_failure marks them); anything else it raises (a refused or reset socket,
    a failed name lookup, a timeout, the driver's own client errors) becomes an OperationalError
    marked the same, so that every failure to connect has one shape."""
    try:
        return dialect.connect(*cargs, **cparams)
    except dialect.loaded_dbapi.Error:
        raise
    except Exception as exc:  # not BaseException: a cancel stays a cancel
        raise OperationalError(None, None, exc, connection_invalidated=True) from exc


def mark_checkout_failure(context: ExceptionContext) -> None:
    """A DBAPI error raised while there is no Connection yet came from opening one, or from the
    ping of a pooled one before it was handed out: no statement of the caller's ran. Marked a
    disconnect, the error says so, and a failed ping makes the pool open a new connection."""
    if context.connection is None:
        context.is_disconnect = True
