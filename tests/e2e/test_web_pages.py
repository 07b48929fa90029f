"""A web page against a real `fleet gateway` on loopback with no token (what `fleet up` runs): its
own name rebound to 127.0.0.1 reaches nothing, and a cross-site request changes nothing."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import Stack, start_stack, stop_stack, work_dir
from tests.support.policy import private_policy

pytestmark = pytest.mark.e2e
REBOUND = "rebind.attacker.example"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    folder = work_dir("web")
    stack = start_stack(folder, private_policy(folder))  # what an attack changes is a copy
    yield stack
    stop_stack(stack)


def test_a_rebound_name_reaches_neither_the_api_nor_the_settings(stack: Stack) -> None:
    port = stack.url.rsplit(":", 1)[1]
    with stack.client() as client:
        for path in ("/api/settings", "/api/sessions"):
            response = client.get(path, headers={"host": f"{REBOUND}:{port}"})
            assert response.status_code == 421, (path, response.text)
            assert response.json()["code"] == "host_not_allowed"
        revision = client.get("/api/settings").json()["revision"]
        change = {"revision": revision, "set": {"profiles.offline.rlm.max_iters": 3}}
        patched = client.patch("/api/settings", json=change, headers={"host": f"{REBOUND}:{port}"})
        assert patched.status_code == 421
        assert client.get("/api/settings").json()["revision"] == revision


def test_a_cross_site_page_changes_nothing(stack: Stack) -> None:
    page = {"origin": "http://attacker.example", "sec-fetch-site": "cross-site"}
    with stack.client() as client:
        revision = client.get("/api/settings").json()["revision"]
        change = {"revision": revision, "set": {"profiles.offline.rlm.max_iters": 3}}
        assert client.patch("/api/settings", json=change, headers=page).status_code == 403
        created = client.post("/api/sessions", json={"title": "from a page"}, headers=page)
        assert created.status_code == 403 and created.json()["code"] == "origin_not_allowed"
        # A form post (a "simple request": no preflight) of a file, with no Origin at all.
        form = {"attachment": ("x.txt", b"x", "text/plain")}
        upload = httpx.post(f"{stack.url}/api/attachments", files=form, timeout=30)
        assert upload.status_code == 403 and upload.json()["code"] == "upload_header_required"
        assert client.get("/api/settings").json()["revision"] == revision
        assert client.get("/api/sessions", params={"search": "from a page"}).json()["total"] == 0
