"""The files, attachments and artifacts routes in-process (Litestar's test client) on real
SQLite/PostgreSQL, Redis and blob folders: traversal and links give 404, uploads are capped and
streamed, artifact bytes come with ETag, Range and 304."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from litestar.testing import TestClient

from fleet_gateway.app import create_app
from fleet_gateway.routes.files import MAX_LIST, MAX_TREE_ENTRIES, timestamp
from fleet_shared.blobs import open_blob_store
from fleet_shared.config import Settings, load_settings
from fleet_shared.db.engine import create_engine, session_factory
from fleet_shared.db.models import Artifact
from fleet_shared.db.queries import Claimed, claim_turn, now

REPO = Path(__file__).resolve().parents[2]
UPLOAD = {"x-requested-with": "test"}  # uploads need a header no plain web form can send


def settings_in(folder: Path, database_url: str, redis_url: str) -> Settings:
    settings = load_settings(
        {
            "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"),
            "FLEET_DATABASE_URL": database_url,
            "FLEET_REDIS_URL": redis_url,
        }
    )
    return msgspec.structs.replace(settings, data_dir=folder)


@pytest.fixture
def settings(tmp_path: Path, database_url: str, redis_url: str) -> Settings:
    return settings_in(tmp_path, database_url, redis_url)


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:  # type: ignore[type-arg]
    with TestClient(create_app(settings)) as client:
        yield client


def new_session(client: TestClient) -> dict[str, Any]:  # type: ignore[type-arg]
    response = client.post("/api/sessions", json={})
    assert response.status_code == 201
    return dict(response.json())


def workspace_of(settings: Settings, session: dict[str, Any]) -> Path:
    """What the worker's local provider makes on a session's first Turn."""
    folder = settings.workspaces_dir / session["workspace_id"]
    for name in ("memory", "skills", "attachments", "artifacts"):
        (folder / name).mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def planted(settings: Settings, client: TestClient, tmp_path: Path) -> tuple[str, str, Path]:  # type: ignore[type-arg]
    """Two sessions; the first's workspace holds files and every trap a sandbox could plant."""
    mine, theirs = new_session(client), new_session(client)
    folder, other = workspace_of(settings, mine), workspace_of(settings, theirs)
    (folder / "memory" / "note.txt").write_text("remember the milk")
    (other / "memory" / "secret.txt").write_text("theirs")
    outside = tmp_path / "host-secret.txt"
    outside.write_text("host secret")
    (folder / "memory" / "link").symlink_to(outside)
    (folder / "memory" / "dirlink").symlink_to(other / "memory")
    (folder / "artifacts" / "up").symlink_to(folder.parent)
    os.mkfifo(folder / "memory" / "pipe")
    return mine["id"], theirs["id"], folder


def test_listing_stat_and_tree_show_only_files_and_folders(
    client: TestClient,  # type: ignore[type-arg]
    planted: tuple[str, str, Path],
) -> None:
    mine, _theirs, _folder = planted
    listing = client.get("/api/files", params={"session_id": mine, "path": "memory"})
    assert listing.status_code == 200
    assert [item["name"] for item in listing.json()["items"]] == ["note.txt"]  # no link, no FIFO
    root = client.get("/api/files", params={"session_id": mine}).json()
    assert [i["name"] for i in root["items"]] == ["artifacts", "attachments", "memory", "skills"]
    stat = client.get("/api/files/stat", params={"session_id": mine, "path": "memory/note.txt"}).json()
    assert stat["type"] == "file" and stat["byte_size"] == len("remember the milk")
    tree = client.get("/api/volume/tree", params={"session_id": mine, "depth": 2}).json()
    memory = next(c for c in tree["root"]["children"] if c["name"] == "memory")
    assert [c["path"] for c in memory["children"]] == ["memory/note.txt"]
    assert "/" not in str(tree["root"]["path"]) and str(tree).count("host-secret") == 0


@pytest.mark.parametrize(
    "path",
    [
        "../",
        "../../etc/passwd",
        "memory/../../x",
        "/etc/passwd",
        "memory/link",
        "memory/dirlink/secret.txt",
        "memory/dirlink",
        "artifacts/up",
        "artifacts/up/x",
        "memory/pipe",
        "memory/missing.txt",
        "memory\\..\\..",
        "memory/note.txt/x",
    ],
)
@pytest.mark.parametrize("route", ["/api/files", "/api/files/stat", "/api/files/content", "/api/volume/tree"])
def test_traversal_links_and_specials_are_404(
    client: TestClient,  # type: ignore[type-arg]
    planted: tuple[str, str, Path],
    route: str,
    path: str,
) -> None:
    mine, _theirs, _folder = planted
    key = "root" if route == "/api/volume/tree" else "path"
    response = client.get(route, params={"session_id": mine, key: path})
    assert response.status_code == 404, (route, path, response.text)
    assert response.json()["code"] == "not_found"
    assert "host secret" not in response.text and "theirs" not in response.text


def test_foreign_and_unknown_sessions_look_the_same(
    client: TestClient,  # type: ignore[type-arg]
    planted: tuple[str, str, Path],
) -> None:
    mine, theirs, _folder = planted
    mine_file = client.get("/api/files/content", params={"session_id": theirs, "path": "memory/note.txt"})
    unknown = client.get("/api/files", params={"session_id": str(uuid.uuid4()), "path": ""})
    malformed = client.get("/api/files", params={"session_id": "../x", "path": ""})
    assert [r.status_code for r in (mine_file, unknown, malformed)] == [404, 404, 404]
    assert (
        client.get("/api/files/content", params={"session_id": mine, "path": "memory/note.txt"}).json()[
            "content"
        ]
        == "remember the milk"
    )


def test_hostile_names_and_times_do_not_break_listings(
    client: TestClient,  # type: ignore[type-arg]
    planted: tuple[str, str, Path],
) -> None:
    """A sandbox may write a name that is not UTF-8 and set any mtime: listings still answer."""
    mine, _theirs, folder = planted
    os.close(os.open(bytes(folder / "memory") + b"/bad\xff", os.O_CREAT | os.O_WRONLY, 0o644))
    odd = folder / "memory" / "future.txt"
    odd.write_text("x")
    with contextlib.suppress(OSError):  # ext4 clamps such a time; tmpfs and btrfs keep it
        os.utime(odd, (10**12, 10**12))
    assert timestamp(10.0**12) == "" and timestamp(0).startswith("1970")
    listing = client.get("/api/files", params={"session_id": mine, "path": "memory"})
    tree = client.get("/api/volume/tree", params={"session_id": mine})
    assert listing.status_code == 200 and tree.status_code == 200
    names = [i["name"] for i in listing.json()["items"]]
    assert names == ["future.txt", "note.txt"]
    stat = client.get("/api/files/stat", params={"session_id": mine, "path": "memory/future.txt"})
    assert stat.status_code == 200


LINKS = 50_000


@pytest.fixture
def crowded(settings: Settings, client: TestClient) -> str:  # type: ignore[type-arg]
    """A session whose `memory/links/` holds 50,000 symlinks (a cell makes them in a second)."""
    session = new_session(client)
    folder = workspace_of(settings, session) / "memory" / "links"
    folder.mkdir()
    for index in range(LINKS):
        os.symlink("/etc/passwd", folder / f"link-{index:05d}")
    return str(session["id"])


def tree_size(node: dict[str, Any]) -> int:
    return sum(1 + tree_size(child) for child in node.get("children") or [])


def test_entries_that_are_not_shown_still_count_toward_the_bounds(
    client: TestClient,  # type: ignore[type-arg]
    crowded: str,
) -> None:
    """A listing reads at most MAX_LIST entries of a folder and a tree at most MAX_TREE_ENTRIES,
    links included: past that it stops and says `truncated`, however many more there are."""
    listing = client.get("/api/files", params={"session_id": crowded, "path": "memory/links"})
    assert listing.status_code == 200
    assert listing.json()["items"] == [] and listing.json()["truncated"] is True
    assert client.get("/api/files", params={"session_id": crowded, "path": "memory/links"}).json() == (
        listing.json()
    )
    tree = client.get("/api/volume/tree", params={"session_id": crowded, "depth": 3})
    assert tree.status_code == 200 and tree.json()["truncated"] is True
    memory = next(c for c in tree.json()["root"]["children"] if c["name"] == "memory")
    assert [c["name"] for c in memory["children"]] == ["links"] and memory["children"][0]["children"] == []
    assert tree_size(tree.json()["root"]) <= MAX_TREE_ENTRIES


def test_a_long_listing_is_cut_at_max_list_in_name_order(
    client: TestClient,  # type: ignore[type-arg]
    planted: tuple[str, str, Path],
) -> None:
    mine, _theirs, folder = planted
    many = folder / "memory" / "many"
    many.mkdir()
    for index in range(MAX_LIST + 5):
        (many / f"f{index:05d}").touch()
    listing = client.get("/api/files", params={"session_id": mine, "path": "memory/many"}).json()
    names = [item["name"] for item in listing["items"]]
    assert listing["truncated"] is True and len(names) == MAX_LIST and names == sorted(names)
    tree = client.get("/api/volume/tree", params={"session_id": mine, "depth": 3}).json()
    assert tree["truncated"] is False and tree_size(tree["root"]) > MAX_LIST  # a tree's own bound


def test_a_page_too_small_for_a_character_still_moves_on(
    client: TestClient,  # type: ignore[type-arg]
    planted: tuple[str, str, Path],
) -> None:
    mine, _theirs, folder = planted
    (folder / "memory" / "broken.txt").write_bytes(b"\xf0\x9f\x98x")
    seen, cursor = [], ""
    for _ in range(10):
        params = {"session_id": mine, "path": "memory/broken.txt", "max_chars": 1, "cursor": cursor}
        page = client.get("/api/files/content", params=params).json()
        seen.append(page["content"])
        if page["next_cursor"] is None:
            break
        assert int(page["next_cursor"]) > int(cursor or 0)
        cursor = page["next_cursor"]
    assert seen[-1] == "x" and len(seen) <= 4


def test_content_pages_never_split_a_character(
    client: TestClient,  # type: ignore[type-arg]
    planted: tuple[str, str, Path],
) -> None:
    mine, _theirs, folder = planted
    text = "añb€c😀d" * 50
    (folder / "memory" / "utf8.txt").write_text(text, encoding="utf-8")
    pieces, cursor, pages = [], "", 0
    while True:
        params = {"session_id": mine, "path": "memory/utf8.txt", "max_chars": 7, "cursor": cursor}
        page = client.get("/api/files/content", params=params).json()
        assert len(page["content"]) <= 7
        pieces.append(page["content"])
        pages += 1
        if page["next_cursor"] is None:
            break
        assert int(page["next_cursor"]) > int(cursor or 0)
        cursor = page["next_cursor"]
    assert "".join(pieces) == text and pages > 10
    (folder / "memory" / "blob.bin").write_bytes(b"\x00\x01binary")
    binary = client.get("/api/files/content", params={"session_id": mine, "path": "memory/blob.bin"})
    assert binary.status_code == 415


def test_attachment_upload_is_capped_checked_and_described(
    client: TestClient,  # type: ignore[type-arg]
    settings: Settings,
) -> None:
    data = os.urandom(300_000)
    ok = client.post(
        "/api/attachments",
        files={"attachment": ("../../etc/pa ss$wd.bin", data, "application/zip")},
        headers=UPLOAD,
    )
    assert ok.status_code == 201, ok.text
    body = ok.json()
    assert body["filename"] == "pa ss_wd.bin" and body["byte_size"] == len(data)
    assert body["checksum_sha256"] == hashlib.sha256(data).hexdigest()
    stored = settings.blobs_dir / "attachments" / body["id"]
    assert stored.read_bytes() == data
    assert client.get(f"/api/attachments/{body['id']}").json() == body
    assert client.get(f"/api/attachments/{uuid.uuid4()}").status_code == 404
    assert client.get("/api/attachments/not-a-uuid").status_code == 404

    limit = settings.profile.storage.max_attachment_mb * 2**20
    big = client.post(
        "/api/attachments",
        files={"attachment": ("big.bin", b"x" * (limit + 1), "text/plain")},
        headers=UPLOAD,
    )
    assert big.status_code == 413 and big.json()["code"] == "payload_too_large"
    wrong_field = client.post(
        "/api/attachments", files={"file": ("a.txt", b"a", "text/plain")}, headers=UPLOAD
    )
    assert wrong_field.status_code == 422
    not_multipart = client.post(
        "/api/attachments", content=b"{}", headers={"content-type": "application/json", **UPLOAD}
    )
    assert not_multipart.status_code == 415
    broken = client.post(
        "/api/attachments",
        content=b'--b\r\nContent-Disposition: form-data; name="attachment"\r\n\r\nno end',
        headers={"content-type": "multipart/form-data; boundary=b", **UPLOAD},
    )
    assert broken.status_code == 422
    body = (
        b'--b\r\nContent-Disposition: form-data; name="attachment"; filename="split.txt"\r\n\r\n'
        b"hello\r\n--b--\r\n"
    )
    split = client.post(
        "/api/attachments",
        content=iter([body[:-2], body[-2:]]),  # the closing CRLF arrives on its own
        headers={"content-type": "multipart/form-data; boundary=b", **UPLOAD},
    )
    assert split.status_code == 201 and split.json()["byte_size"] == 5
    leftovers = list((settings.data_dir / "uploads").iterdir())
    assert leftovers == []  # refused uploads leave no temporary file behind


def add_artifact(settings: Settings, session_id: str, data: bytes, name: str) -> tuple[str, str]:
    """A queued Run in the session and an artifact of it (its row and its bytes)."""
    artifact_id = str(uuid.uuid4())
    run_ids: list[str] = []
    store = open_blob_store(settings)
    source = settings.data_dir / "artifact.tmp"
    source.write_bytes(data)
    store.put_file(f"artifacts/{artifact_id}", source)

    async def insert() -> None:
        engine = create_engine(settings.database_url)
        async with session_factory(engine)() as db:
            claimed = await claim_turn(
                db, session_id=session_id, idempotency_key="a1", fingerprint="f", text="hi", model="m"
            )
            assert isinstance(claimed, Claimed)
            run_ids.append(claimed.run.id)
            db.add(
                Artifact(
                    id=artifact_id,
                    run_id=claimed.run.id,
                    session_id=session_id,
                    name=name,
                    media_type="text/html",
                    byte_size=len(data),
                    checksum_sha256=hashlib.sha256(data).hexdigest(),
                    created_at=now(),
                )
            )
            await db.commit()
        await engine.dispose()

    asyncio.run(insert())
    return artifact_id, run_ids[0]


def test_artifact_content_ranges_etag_and_headers(
    client: TestClient,  # type: ignore[type-arg]
    settings: Settings,
) -> None:
    session = new_session(client)
    data = bytes(range(256)) * 40
    artifact_id, run_id = add_artifact(settings, session["id"], data, "out/räport <1>.html")
    url = f"/api/artifacts/{artifact_id}/content"
    whole = client.get(url)
    etag = f'"{hashlib.sha256(data).hexdigest()}"'
    assert whole.status_code == 200 and whole.content == data
    assert whole.headers["etag"] == etag and whole.headers["content-length"] == str(len(data))
    assert whole.headers["x-content-type-options"] == "nosniff"
    disposition = whole.headers["content-disposition"]
    assert (
        disposition.startswith("attachment;") and "filename*=UTF-8''r%C3%A4port%20%3C1%3E.html" in disposition
    )
    cases = {
        "bytes=0-0": data[:1],
        "bytes=100-": data[100:],
        "bytes=-10": data[-10:],
        "bytes=10-99999": data[10:],
    }
    for header, expected in cases.items():
        part = client.get(url, headers={"Range": header})
        assert part.status_code == 206 and part.content == expected, header
        assert part.headers["content-length"] == str(len(expected))
    assert client.get(url, headers={"Range": f"bytes={len(data)}-"}).status_code == 416
    assert client.get(url, headers={"Range": "bytes=5-1"}).content == data  # invalid: ignored (RFC 9110)
    assert (
        client.get(url, headers={"Range": f"bytes={'9' * 5000}-"}).content == data
    )  # no 500 on huge numbers
    assert client.get(url, headers={"Range": "bytes=1-2,5-6"}).content == data  # multi-range: whole file
    assert client.get(url, headers={"If-None-Match": etag}).status_code == 304
    assert client.get(url, headers={"If-None-Match": '"other"'}).status_code == 200
    meta = client.get(f"/api/artifacts/{artifact_id}").json()
    assert meta["name"] == "out/räport <1>.html" and meta["run_id"] == run_id
    assert client.get(f"/api/artifacts/{uuid.uuid4()}/content").status_code == 404
    (settings.blobs_dir / "artifacts" / artifact_id).unlink()
    assert client.get(url).status_code == 404  # the row outlived its bytes: no half response
