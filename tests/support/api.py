"""The typed test client of the gateway's Litestar app: one alias, so no test needs an ignore."""

from __future__ import annotations

from typing import Any, TypeAlias

from litestar import Litestar
from litestar.testing import TestClient

ApiClient: TypeAlias = TestClient[Litestar]


def new_session(client: Any, title: str = "") -> str:
    """A new session, made through the API (a test client, or an httpx client of a live stack);
    its id."""
    return str(session_row(client, title)["id"])


def session_row(client: Any, title: str = "") -> dict[str, Any]:
    """A new session's row as `POST /api/sessions` answers it."""
    response = client.post("/api/sessions", json={"title": title})
    assert response.status_code == 201, response.text
    return dict(response.json())
