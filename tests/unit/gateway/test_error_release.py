"""An error response releases its request at once, not at the next cyclic garbage collection.

Litestar throws a handler's exception into its generator dependencies (`provide_db`), and the
frame that does so keeps the exception as a local: exception → traceback → frame → exception.
Until the cyclic collector runs, that cycle holds the handler's frames and with them the request.
Granian keeps a connection whose request body was not read open for as long as the request lives,
so an idle upload's 408 would leave its socket open on a quiet gateway."""

from __future__ import annotations

import gc
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import pytest
from litestar import Litestar, get
from litestar.di import NamedDependency, Provide
from litestar.testing import TestClient
from structlog.testing import capture_logs

from fleet_gateway.errors import EXCEPTION_HANDLERS, ApiError


class Held:
    """Something a handler's frame holds, as it holds the request."""


alive: list[weakref.ref[Held]] = []


async def provide_resource() -> AsyncIterator[str]:
    yield "resource"  # a generator dependency, like the gateway's database session


@get("/fails")
async def fails(resource: NamedDependency[str]) -> None:
    held = Held()
    alive.append(weakref.ref(held))
    raise ApiError(408, "upload_timeout", f"{resource}: the upload sent nothing")


@get("/breaks")
async def breaks(resource: NamedDependency[str]) -> None:
    held = Held()
    alive.append(weakref.ref(held))
    raise RuntimeError(f"{resource}: an unexpected failure")


@contextmanager
def no_cyclic_collection() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize(("path", "status"), [("/fails", 408), ("/breaks", 500)])
def test_an_error_response_frees_the_handlers_frame_without_the_collector(path: str, status: int) -> None:
    app = Litestar(
        route_handlers=[fails, breaks],
        dependencies={"resource": Provide(provide_resource)},
        exception_handlers=EXCEPTION_HANDLERS,
    )
    alive.clear()
    with capture_logs() as logged, TestClient(app) as client, no_cyclic_collection():
        assert client.get(path).status_code == status
        assert len(alive) == 1
        assert alive[0]() is None, "the handler's frame is still held, by a reference cycle"
    failures = [entry for entry in logged if entry["event"] == "request.failed"]
    assert len(failures) == (status == 500)  # the unexpected one is still logged with its traceback
    assert all(entry["exc_info"].__traceback__ is not None for entry in failures)
