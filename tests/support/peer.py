"""The gateway app as seen from one socket peer (Litestar's test client always says `testclient`)."""

from __future__ import annotations

from litestar import Litestar
from litestar.enums import ScopeType
from litestar.testing import TestClient
from litestar.types import Receive, Scope, Send

from fleet_gateway.app import create_app
from fleet_shared.config import Settings
from tests.support.api import ApiClient


class FromPeer:
    def __init__(self, app: Litestar, host: str) -> None:
        self.app, self.host = app, host

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == ScopeType.HTTP:
            scope["client"] = (self.host, 50000)
        await self.app(scope, receive, send)


def peer_client(settings: Settings, host: str) -> ApiClient:
    """A test client whose requests come from `host` (the app inside is the same Litestar app)."""
    return TestClient(FromPeer(create_app(settings), host))  # type: ignore[arg-type]
