"""Uploads through a real `fleet gateway` (Granian): one that stops sending is answered 408
`upload_timeout` after `gateway.limits.upload_idle_seconds`, its connection closed and its
temporary file removed; a client with `max_concurrent_uploads_per_client` uploads in progress
gets 429 `too_many_uploads` for the next one, until one of them finishes."""

from __future__ import annotations

import json
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import REPO, stop
from tests.e2e.test_metrics_ports import answers, eventually, fleet_env, start
from tests.support.servers import free_port

pytestmark = pytest.mark.e2e
BOUNDARY = "b0undary"
PART_HEAD = (
    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="attachment"; filename="slow.txt"\r\n'
    "Content-Type: text/plain\r\n\r\n"
).encode()
PART_TAIL = f"\r\n--{BOUNDARY}--\r\n".encode()
GUARD_SECONDS = 60  # only bounds a test that fails; every wait below ends on observable state
UPLOAD = {"x-requested-with": "test"}  # an upload needs a header no plain web form can send


@dataclass
class Gateway:
    port: int
    uploads: Path  # the gateway's folder of temporary upload files


@contextmanager
def gateway(folder: Path, redis_url: str, database_url: str, **limits: object) -> Iterator[Gateway]:
    """A gateway process alone (no worker: uploads need none) with these `gateway.limits`."""
    config = folder / "config"
    shutil.copytree(REPO / "config", config)
    toml = config / "fleet.toml"
    table = "[profiles.offline.gateway.limits]\n"
    extra = "".join(f"{key} = {value}\n" for key, value in limits.items())
    toml.write_text(toml.read_text().replace(table, table + extra, 1))
    port = free_port()
    env = fleet_env(redis_url, database_url, FLEET_CONFIG=str(toml))
    log = folder / "gateway.log"
    process = start(["gateway", "--port", str(port)], env, folder, log)
    try:
        health = f"http://127.0.0.1:{port}/health"
        eventually(lambda: answers(health) or process.poll() is not None, GUARD_SECONDS)
        assert process.poll() is None, log.read_text()[-3000:]
        yield Gateway(port, folder / ".fleet" / "uploads")
    finally:
        stop([process])


def begin_upload(gw: Gateway, source: str = "127.0.0.1") -> tuple[socket.socket, bytes]:
    """An upload whose headers and first byte of file are sent, and the rest of its body."""
    body = PART_HEAD + b"x" * 10 + PART_TAIL
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=GUARD_SECONDS, source_address=(source, 0))
    sock.sendall(
        f"POST /api/attachments HTTP/1.1\r\nHost: 127.0.0.1:{gw.port}\r\nX-Requested-With: test\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
    )
    sent = len(PART_HEAD) + 1
    sock.sendall(body[:sent])
    return sock, body[sent:]


def response_of(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of the one response on the connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed without a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "closed in the middle of the response"
        body += chunk
    return int(lines[0].split()[1]), json.loads(body)


def closed(sock: socket.socket) -> bool:
    """The server closed the connection (EOF or a reset), rather than waiting on the client."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def temp_files(gw: Gateway) -> list[Path]:
    return list(gw.uploads.glob("upload-*")) if gw.uploads.exists() else []


def test_an_idle_upload_is_closed_and_its_file_removed(
    traversable_dir: Path, redis_url: str, sqlite_url: str
) -> None:
    with gateway(traversable_dir, redis_url, sqlite_url, upload_idle_seconds=1) as gw:
        sock, _rest = begin_upload(gw)
        with sock:
            eventually(lambda: len(temp_files(gw)) == 1, GUARD_SECONDS)  # the file is being received
            status, body = response_of(sock)  # while nothing more is sent
            assert (status, body["code"]) == (408, "upload_timeout"), body
            assert "nothing for 1 s" in body["message"]
            assert closed(sock)
        assert temp_files(gw) == []
        with httpx.Client(base_url=f"http://127.0.0.1:{gw.port}", headers=UPLOAD) as client:
            whole = client.post("/api/attachments", files={"attachment": ("a.txt", b"fine", "text/plain")})
        assert whole.status_code == 201, whole.text  # the gateway takes the next upload as before


def test_a_client_at_its_upload_cap_gets_429_until_one_finishes(
    traversable_dir: Path, redis_url: str, sqlite_url: str
) -> None:
    limits = {"upload_idle_seconds": 300, "max_concurrent_uploads_per_client": 2}
    with gateway(traversable_dir, redis_url, sqlite_url, **limits) as gw:
        url = f"http://127.0.0.1:{gw.port}"
        small = {"attachment": ("a.txt", b"fine", "text/plain")}
        first, first_rest = begin_upload(gw)
        second, _second_rest = begin_upload(gw)
        with first, second:
            eventually(lambda: len(temp_files(gw)) == 2, GUARD_SECONDS)
            with httpx.Client(base_url=url, headers=UPLOAD) as client:
                refused = client.post("/api/attachments", files=small)
            assert refused.status_code == 429 and refused.json()["code"] == "too_many_uploads", refused.text
            assert refused.headers["retry-after"].isdigit()
            other = httpx.HTTPTransport(local_address="127.0.0.2")
            with httpx.Client(base_url=url, transport=other, headers=UPLOAD) as elsewhere:
                assert elsewhere.post("/api/attachments", files=small).status_code == 201  # another client
            first.sendall(first_rest)
            status, body = response_of(first)
            assert status == 201 and body["byte_size"] == 10
            with httpx.Client(base_url=url, headers=UPLOAD) as client:
                again = client.post("/api/attachments", files=small)
            assert again.status_code == 201, again.text  # a slot is free again
