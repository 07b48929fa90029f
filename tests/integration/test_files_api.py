"""The files, attachments and artifacts routes in-process (Litestar's test client) on real
SQLite/PostgreSQL, Redis and a blob folder. The files API reads a session's workspace versions
(manifests in the database, bytes in the store) and no disk: the gateway here has a data dir of
its own, shared with nothing but the store. Hostile paths give 404, versions are read by number
or by Run, uploads are capped and streamed, artifact bytes come with ETag, Range and 304."""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
from litestar.testing import TestClient

from fleet_gateway.app import create_app
from fleet_gateway.routes.files import MAX_LIST, MAX_TREE_ENTRIES, timestamp
from fleet_shared.blobs import open_blob_store
from fleet_shared.config import ResolvedBlobs, Settings, load_settings
from fleet_shared.db.claims import Claimed, claim_turn
from fleet_shared.db.engine import create_engine, run_whole, session_factory
from fleet_shared.db.models import Artifact, Attachment, Workspace, utcnow
from fleet_shared.db.workspace_versions import WorkspaceChange, record_on
from fleet_shared.manifests import FileEntry, Manifest, object_key
from fleet_shared.tenancy import OPERATOR
from tests.support.api import ApiClient, session_row

REPO = Path(__file__).resolve().parents[2]
UPLOAD = {"x-requested-with": "test"}  # uploads need a header no plain web form can send
MTIME_NS = 1_700_000_000_123_456_789
Files = dict[str, bytes]


def settings_in(folder: Path, database_url: str, redis_url: str, store: Path | None = None) -> Settings:
    """A gateway's settings on its own data dir, and on the local store in `store` (if given)."""
    settings = load_settings(
        {
            "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"),
            "FLEET_DATABASE_URL": database_url,
            "FLEET_REDIS_URL": redis_url,
        }
    )
    settings = msgspec.structs.replace(settings, data_dir=folder)
    if store is None:
        return settings
    return msgspec.structs.replace(settings, blobs=ResolvedBlobs(backend="local", local_dir=store))


@pytest.fixture
def settings(tmp_path: Path, database_url: str, redis_url: str) -> Settings:
    """The gateway's: its own data dir; the store is the one thing it shares."""
    return settings_in(tmp_path / "gateway", database_url, redis_url, tmp_path / "store")


@pytest.fixture
def client(settings: Settings) -> Iterator[ApiClient]:
    with TestClient(create_app(settings)) as client:
        yield client


def record_version(
    settings: Settings,
    workspace_id: str,
    files: Files,
    *,
    run_id: str | None = None,
    mtime_ns: int = MTIME_NS,
    store: bool = True,
    added_bytes: int = 0,
) -> int:
    """The workspace's next version, as a Run's commit records it: the files' bytes put in the
    store first (unless `store` is false), then the manifest. Its number."""
    objects = open_blob_store(settings)
    entries = []
    staging = settings.data_dir / "object.tmp"
    staging.parent.mkdir(parents=True, exist_ok=True)
    for path, data in files.items():
        sha256 = hashlib.sha256(data).hexdigest()
        if store:
            staging.write_bytes(data)
            objects.put_file(object_key(sha256), staging)
        entries.append(FileEntry(path, len(data), 0o644, sha256, mtime_ns))

    def commit(db: Any) -> int:
        workspace = db.get(Workspace, workspace_id)
        seen = workspace.version if workspace is not None else 0
        change = WorkspaceChange(
            workspace_id=workspace_id,
            seen_version=seen,
            manifest=Manifest.of(entries),
            added_bytes=added_bytes,
        )
        assert record_on(db, change, run_id)
        db.commit()
        return seen + 1

    async def run() -> int:
        engine = create_engine(settings.database_url)
        try:
            return await run_whole(session_factory(engine), commit)
        finally:
            await engine.dispose()

    return asyncio.run(run())


def add_run(settings: Settings, session_id: str, key: str, attachment_ids: Sequence[str] = ()) -> str:
    """A queued Run in the session (its user Turn claimed, as the gateway does), its user Turn
    naming these attachments."""

    async def claim() -> str:
        engine = create_engine(settings.database_url)
        try:
            async with session_factory(engine)() as db:
                attached = [await db.get(Attachment, attachment_id) for attachment_id in attachment_ids]
                claimed = await claim_turn(
                    db,
                    caller=OPERATOR,
                    session_id=session_id,
                    idempotency_key=key,
                    fingerprint="f",
                    text="hi",
                    model="m",
                    attachments=[a for a in attached if a is not None],
                )
        finally:
            await engine.dispose()
        assert isinstance(claimed, Claimed)
        return claimed.run.id

    return asyncio.run(claim())


MINE: Files = {
    "memory/note.txt": b"remember the milk",
    "memory/deep/er/kept.bin": bytes(range(256)),
    "artifacts/r.txt": b"a report",
}


@pytest.fixture
def planted(settings: Settings, client: ApiClient) -> tuple[str, str]:
    """Two sessions, each with a version of its own files."""
    mine, theirs = session_row(client), session_row(client)
    record_version(settings, mine["workspace_id"], MINE)
    record_version(settings, theirs["workspace_id"], {"memory/secret.txt": b"theirs"})
    return mine["id"], theirs["id"]


def get(client: ApiClient, route: str, **params: Any) -> Any:
    return client.get(route, params=params)


def test_listing_stat_and_tree_show_the_latest_versions_files_and_implied_folders(
    client: ApiClient,
    planted: tuple[str, str],
) -> None:
    mine, _theirs = planted
    listing = get(client, "/api/files", session_id=mine, path="memory")
    assert listing.status_code == 200, listing.text
    assert listing.json() == {
        "session_id": mine,
        "path": "memory",
        "items": [
            {"name": "deep", "path": "memory/deep", "type": "directory"},
            {
                "name": "note.txt",
                "path": "memory/note.txt",
                "type": "file",
                "byte_size": len(MINE["memory/note.txt"]),
                "modified_at": timestamp(MTIME_NS / 1e9),
            },
        ],
        "truncated": False,
    }
    root = get(client, "/api/files", session_id=mine).json()
    assert [(i["name"], i["type"]) for i in root["items"]] == [
        ("artifacts", "directory"),
        ("attachments", "directory"),
        ("memory", "directory"),
        ("skills", "directory"),
    ]
    stat = get(client, "/api/files/stat", session_id=mine, path="memory/deep/er/kept.bin").json()
    assert (
        stat["type"] == "file" and stat["byte_size"] == 256 and stat["modified_at"].startswith("2023-11-14")
    )
    folder = get(client, "/api/files/stat", session_id=mine, path="memory/deep/").json()
    assert folder == {"name": "deep", "path": "memory/deep", "type": "directory"}
    tree = get(client, "/api/volume/tree", session_id=mine, depth=2).json()
    assert tree["truncated"] is False and tree["root"]["path"] == ""
    memory = next(c for c in tree["root"]["children"] if c["name"] == "memory")
    assert [c["path"] for c in memory["children"]] == ["memory/deep", "memory/note.txt"]
    assert "children" not in memory["children"][0]  # past the depth: not walked
    deep = get(client, "/api/volume/tree", session_id=mine, root="memory/deep", depth=8).json()
    assert deep["root"]["children"][0]["children"][0]["path"] == "memory/deep/er/kept.bin"
    content = get(client, "/api/files/content", session_id=mine, path="memory/note.txt").json()
    assert content["content"] == "remember the milk" and content["next_cursor"] is None


def test_a_session_with_no_version_shows_the_empty_layout_folders(
    client: ApiClient,
) -> None:
    session = session_row(client)["id"]
    root = get(client, "/api/files", session_id=session)
    assert root.status_code == 200, root.text
    assert [i["name"] for i in root.json()["items"]] == ["artifacts", "attachments", "memory", "skills"]
    assert get(client, "/api/files", session_id=session, path="memory").json()["items"] == []
    tree = get(client, "/api/volume/tree", session_id=session).json()
    assert [c["children"] for c in tree["root"]["children"]] == [[], [], [], []]
    assert get(client, "/api/files/stat", session_id=session, path="skills").json()["type"] == "directory"
    assert get(client, "/api/files/content", session_id=session, path="memory/x").status_code == 404
    assert get(client, "/api/files", session_id=session, version=1).status_code == 404


@pytest.mark.parametrize(
    "path",
    [
        "../",
        "../../etc/passwd",
        "memory/../../x",
        "/etc/passwd",
        "memory/link",
        "memory/missing.txt",
        "memory\\..\\..",
        "memory/note.txt/x",
        "memory/deep/er/kept.bin/..",
        "memory/dee",
        "memory/note",
        "nothing",
        "memory/secret.txt",  # the other session's
        "..\x00",
        "x/" * 300,
    ],
)
@pytest.mark.parametrize("route", ["/api/files", "/api/files/stat", "/api/files/content", "/api/volume/tree"])
def test_traversal_odd_and_missing_paths_are_the_same_404(
    client: ApiClient,
    planted: tuple[str, str],
    route: str,
    path: str,
) -> None:
    mine, _theirs = planted
    key = "root" if route == "/api/volume/tree" else "path"
    response = client.get(route, params={"session_id": mine, key: path})
    expected = 422 if "\x00" in path else 404  # a NUL is refused by the schema, before any lookup
    assert response.status_code == expected, (route, path, response.text)
    assert response.json()["code"] == ("validation_error" if expected == 422 else "not_found")
    assert "theirs" not in response.text


@pytest.mark.parametrize("route", ["/api/files", "/api/volume/tree"])
def test_a_file_is_not_a_folder_and_a_folder_has_no_content(
    client: ApiClient,
    planted: tuple[str, str],
    route: str,
) -> None:
    mine, _theirs = planted
    key = "root" if route == "/api/volume/tree" else "path"
    assert client.get(route, params={"session_id": mine, key: "memory/note.txt"}).status_code == 404
    assert get(client, "/api/files/content", session_id=mine, path="memory/deep").status_code == 404


def test_foreign_and_unknown_sessions_look_the_same(
    client: ApiClient,
    planted: tuple[str, str],
) -> None:
    mine, theirs = planted
    mine_file = get(client, "/api/files/content", session_id=theirs, path="memory/note.txt")
    unknown = get(client, "/api/files", session_id=str(uuid.uuid4()), path="")
    malformed = get(client, "/api/files", session_id="../x", path="")
    assert [r.status_code for r in (mine_file, unknown, malformed)] == [404, 404, 404]
    assert get(client, "/api/files/content", session_id=mine, path="memory/note.txt").json()["content"] == (
        "remember the milk"
    )


def test_odd_names_and_times_do_not_break_listings(
    client: ApiClient,
    settings: Settings,
) -> None:
    """A sandbox may name a file oddly and set any mtime: listings still answer."""
    session = session_row(client)
    odd = {
        "memory/ a b ": b"1",
        "memory/…": b"2",
        "memory/-n": b"3",
        "memory/x\ny": b"4",
        "memory/ü.txt": b"5",
    }
    record_version(settings, session["workspace_id"], odd, mtime_ns=10**30)
    assert timestamp(10.0**21) == "" and timestamp(0).startswith("1970")
    listing = get(client, "/api/files", session_id=session["id"], path="memory")
    assert listing.status_code == 200
    assert [i["name"] for i in listing.json()["items"]] == sorted(name.split("/")[1] for name in odd)
    assert all("modified_at" not in i for i in listing.json()["items"])  # no calendar holds that time
    for path, data in odd.items():
        page = get(client, "/api/files/content", session_id=session["id"], path=path)
        assert page.status_code == 200 and page.json()["content"] == data.decode()


def tree_size(node: dict[str, Any]) -> int:
    return sum(1 + tree_size(child) for child in node.get("children") or [])


def test_listings_and_trees_are_cut_at_their_bounds(
    client: ApiClient,
    settings: Settings,
) -> None:
    """A listing shows at most MAX_LIST entries of a folder and a tree at most MAX_TREE_ENTRIES:
    past that it stops and says `truncated`, however many files the version holds."""
    session = session_row(client)
    crowd = {f"memory/many/f{n:05d}": b"" for n in range(MAX_LIST + 5)}
    folders = {f"memory/folders/d{n:04d}/f": b"" for n in range(MAX_TREE_ENTRIES)}
    record_version(settings, session["workspace_id"], {**crowd, **folders, "memory/z.txt": b"z"}, store=False)
    listing = get(client, "/api/files", session_id=session["id"], path="memory/many").json()
    names = [item["name"] for item in listing["items"]]
    assert listing["truncated"] is True and names == sorted(p.rpartition("/")[2] for p in crowd)[:MAX_LIST]
    memory = get(client, "/api/files", session_id=session["id"], path="memory").json()
    assert [i["name"] for i in memory["items"]] == ["folders", "many", "z.txt"] and not memory["truncated"]
    tree = get(client, "/api/volume/tree", session_id=session["id"], depth=8).json()
    assert tree["truncated"] is True and tree_size(tree["root"]) <= MAX_TREE_ENTRIES
    small = get(client, "/api/volume/tree", session_id=session["id"], root="memory/folders/d0001").json()
    assert small["truncated"] is False and small["root"]["children"][0]["path"] == "memory/folders/d0001/f"


def test_a_page_too_small_for_a_character_still_moves_on(
    client: ApiClient,
    settings: Settings,
) -> None:
    session = session_row(client)
    record_version(settings, session["workspace_id"], {"memory/broken.txt": b"\xf0\x9f\x98x"})
    seen, cursor = [], ""
    for _ in range(10):
        params = {"session_id": session["id"], "path": "memory/broken.txt", "max_chars": 1, "cursor": cursor}
        page = client.get("/api/files/content", params=params).json()
        seen.append(page["content"])
        if page["next_cursor"] is None:
            break
        assert int(page["next_cursor"]) > int(cursor or 0)
        cursor = page["next_cursor"]
    assert seen[-1] == "x" and len(seen) <= 4


def test_content_pages_never_split_a_character_and_binary_is_415(
    client: ApiClient,
    settings: Settings,
) -> None:
    session = session_row(client)
    text = "añb€c😀d" * 50
    files = {"memory/utf8.txt": text.encode(), "memory/blob.bin": b"\x00\x01binary", "memory/empty": b""}
    record_version(settings, session["workspace_id"], files)
    pieces, cursor, pages = [], "", 0
    while True:
        params = {"session_id": session["id"], "path": "memory/utf8.txt", "max_chars": 7, "cursor": cursor}
        page = client.get("/api/files/content", params=params).json()
        assert len(page["content"]) <= 7 and page["byte_size"] == len(text.encode())
        pieces.append(page["content"])
        pages += 1
        if page["next_cursor"] is None:
            break
        assert int(page["next_cursor"]) > int(cursor or 0)
        cursor = page["next_cursor"]
    assert "".join(pieces) == text and pages > 10
    binary = get(client, "/api/files/content", session_id=session["id"], path="memory/blob.bin")
    assert binary.status_code == 415 and binary.json()["code"] == "unsupported_media_type"
    empty = get(client, "/api/files/content", session_id=session["id"], path="memory/empty").json()
    assert empty["content"] == "" and empty["next_cursor"] is None
    past = get(client, "/api/files/content", session_id=session["id"], path="memory/empty", cursor="1")
    assert past.status_code == 422


def test_a_file_whose_bytes_are_gone_from_the_store_is_404_not_a_500(
    client: ApiClient,
    settings: Settings,
) -> None:
    session = session_row(client)
    record_version(settings, session["workspace_id"], {"memory/lost.txt": b"never stored"}, store=False)
    assert get(client, "/api/files/stat", session_id=session["id"], path="memory/lost.txt").status_code == 200
    lost = get(client, "/api/files/content", session_id=session["id"], path="memory/lost.txt")
    assert lost.status_code == 404 and lost.json()["code"] == "not_found"


def test_any_version_reads_by_number_or_by_run(
    client: ApiClient,
    settings: Settings,
    planted: tuple[str, str],
) -> None:
    session = session_row(client)
    first, second = add_run(settings, session["id"], "k1"), str(uuid.uuid4())
    record_version(settings, session["workspace_id"], {"memory/note.txt": b"first"}, run_id=first)
    record_version(settings, session["workspace_id"], {"memory/note.txt": b"second", "memory/new.txt": b"n"})
    sid = session["id"]

    def note(**chosen: Any) -> Any:
        return get(client, "/api/files/content", session_id=sid, path="memory/note.txt", **chosen)

    assert note().json()["content"] == "second"
    assert note(version=2).json()["content"] == "second"
    assert note(version=1).json()["content"] == "first"
    assert note(run_id=first).json()["content"] == "first"
    assert note(run_id=first.upper()).json()["content"] == "first"  # any spelling of the UUID
    assert get(client, "/api/files", session_id=sid, path="memory", version=1).json()["items"][0]["name"] == (
        "note.txt"
    )
    assert [i["name"] for i in get(client, "/api/files", session_id=sid, path="memory").json()["items"]] == [
        "new.txt",
        "note.txt",
    ]
    assert get(client, "/api/files/stat", session_id=sid, path="memory/new.txt", version=1).status_code == 404
    tree = get(client, "/api/volume/tree", session_id=sid, root="memory", run_id=first).json()
    assert [c["name"] for c in tree["root"]["children"]] == ["note.txt"]
    _mine, theirs = planted
    other_run = add_run(settings, theirs, "k-other")
    for chosen in ({"version": 3}, {"run_id": second}, {"run_id": "not-a-uuid"}, {"run_id": other_run}):
        response = note(**chosen)
        assert response.status_code == 404 and response.json()["code"] == "not_found", chosen
    for chosen in ({"version": 1, "run_id": first}, {"version": 0}, {"version": -1}, {"version": "x"}):
        response = note(**chosen)
        assert response.status_code == 422 and response.json()["code"] == "validation_error", chosen


def test_the_versions_list_pages_newest_first(
    client: ApiClient,
    settings: Settings,
) -> None:
    session = session_row(client)
    url = f"/api/sessions/{session['id']}/workspace/versions"
    assert client.get(url).json() == {"items": [], "next_before_version": None}
    run_id = add_run(settings, session["id"], "k1")
    record_version(settings, session["workspace_id"], {"memory/a": b"aa"}, run_id=run_id)
    record_version(settings, session["workspace_id"], {"memory/a": b"aa", "memory/b": b"bbb"})
    record_version(settings, session["workspace_id"], {})
    whole = client.get(url).json()
    assert [(i["version"], i["file_count"], i["byte_size"]) for i in whole["items"]] == [
        (3, 0, 0),
        (2, 2, 5),
        (1, 1, 2),
    ]
    assert whole["items"][2]["run_id"] == run_id and whole["items"][0]["run_id"] is None
    assert whole["next_before_version"] is None and whole["items"][0]["created_at"].endswith("Z")
    pages, params = [], {"limit": 2}
    while True:
        page = client.get(url, params=params).json()
        pages.append([i["version"] for i in page["items"]])
        if page["next_before_version"] is None:
            break
        params = {"limit": 2, "before_version": page["next_before_version"]}
    assert pages == [[3, 2], [1]]
    assert client.get(f"/api/sessions/{uuid.uuid4()}/workspace/versions").status_code == 404
    assert client.get(url, params={"limit": 0}).status_code == 422


def test_attachment_upload_is_capped_checked_and_described(
    client: ApiClient,
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
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_bytes(data)
    store.put_file(f"artifacts/{artifact_id}", source)

    async def insert() -> None:
        engine = create_engine(settings.database_url)
        async with session_factory(engine)() as db:
            claimed = await claim_turn(
                db,
                caller=OPERATOR,
                session_id=session_id,
                idempotency_key="a1",
                fingerprint="f",
                text="hi",
                model="m",
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
                    created_at=utcnow(),
                )
            )
            await db.commit()
        await engine.dispose()

    asyncio.run(insert())
    return artifact_id, run_ids[0]


def test_artifact_content_ranges_etag_and_headers(
    client: ApiClient,
    settings: Settings,
) -> None:
    session = session_row(client)
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


@pytest.mark.parametrize(
    ("filename", "sent", "stored"),
    [
        ("README.md", "application/octet-stream", "text/markdown"),
        ("data.csv", None, "text/csv"),
        ("notes.txt", "application/octet-stream", "text/plain"),
        ("report.json", "application/zip", "application/zip"),  # what the client said, when it said something
        ("blob.unknownext", "application/octet-stream", "application/octet-stream"),
    ],
)
def test_an_upload_without_a_real_media_type_gets_one_from_its_name(
    client: ApiClient, filename: str, sent: str | None, stored: str
) -> None:
    part = (filename, b"# hello\n", sent) if sent else (filename, b"# hello\n")
    response = client.post("/api/attachments", files={"attachment": part}, headers=UPLOAD)
    assert response.status_code == 201, response.text
    assert response.json()["media_type"] == stored
