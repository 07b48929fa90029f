"""`fleet eval`'s runner against a gateway that misbehaves the ways real ones can: a stream the
gateway ends before `[DONE]` (its `stream_max_seconds`, a restart), a connection dropped mid-body,
a refused token. A loopback HTTP server stands in for the gateway's API, speaking its protocol."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from fleet_cli.evals.dataset import Metric, load_dataset
from fleet_cli.evals.gateway import TurnRefused
from fleet_cli.evals.runner import Target, run_dataset

TOKEN = "eval-token"


class FakeGateway:
    def __init__(self) -> None:
        self.sessions: dict[str, str] = {}  # session id -> the row's request text
        self.polls: dict[str, int] = {}  # run id -> GET /api/runs reads so far


@pytest.fixture
def gateway() -> Iterator[tuple[str, FakeGateway]]:
    fake = FakeGateway()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def send(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            for key, value in {"content-type": "application/json", **(headers or {})}.items():
                self.send_header(key, value)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def authorized(self) -> bool:
            if self.headers.get("authorization") == f"Bearer {TOKEN}":
                return True
            self.send(401, {"code": "auth_required", "message": "a bearer token is required"})
            return False

        def do_GET(self) -> None:
            if not self.authorized():
                return
            path = self.path.split("?")[0]
            if path in ("/api/sessions", "/api/skills"):
                self.send(200, {"items": []})
            elif path.startswith("/api/runs/"):
                run_id = path.rsplit("/", 1)[1]
                fake.polls[run_id] = fake.polls.get(run_id, 0) + 1
                status = "running" if fake.polls[run_id] < 3 else "completed"
                self.send(200, {"id": run_id, "status": status, "usage": None, "failure_code": None})
            elif path.endswith("/turns"):
                part = {"type": "text", "text": "the answer is 42"}
                self.send(200, {"items": [{"role": "assistant", "parts": [part]}]})

        def do_POST(self) -> None:
            if not self.authorized():
                return
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            if self.path == "/api/sessions":
                session_id = f"s{len(fake.sessions)}"
                fake.sessions[session_id] = ""
                self.send(201, {"id": session_id})
                return
            text = body["text"]
            run_id = f"run-{text}"
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("x-fleet-run-id", run_id)
            if text == "drop":  # the connection goes before the body it announced
                self.send_header("content-length", "1000")
                self.end_headers()
                self.wfile.write(b"data: {}\n\n")
                self.close_connection = True
                return
            frames = b'data: {"type":"start"}\n\n' + (b"data: [DONE]\n\n" if text == "fine" else b"")
            self.send_header("content-length", str(len(frames)))
            self.end_headers()
            self.wfile.write(frames)
            if text == "fine":
                fake.polls[run_id] = 99  # settled when its stream said so

        def log_message(self, *_args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", fake
    server.shutdown()
    server.server_close()


def dataset(tmp_path: Path) -> Any:
    path = tmp_path / "d.jsonl"
    rows = [
        {"id": name, "request": name, "expected": 42, "metric": "numeric"} for name in ("cut", "drop", "fine")
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return load_dataset(path)


def test_a_cut_stream_is_followed_to_the_runs_end_and_a_dropped_one_is_recorded(
    gateway: tuple[str, FakeGateway], tmp_path: Path
) -> None:
    url, fake = gateway
    receipt = run_dataset(
        dataset(tmp_path), Target(url, TOKEN, None, url), concurrency=3, default_metric=Metric(name="numeric")
    )
    rows = {row["id"]: row for row in receipt["rows"]}
    # Its stream ended without [DONE] while the Run still ran: read until it completed.
    assert (rows["cut"]["status"], rows["cut"]["score"]) == ("completed", 1.0)
    assert fake.polls["run-cut"] == 3
    # The connection dropped mid-body: an `error` row scored 0, and the others still ran.
    assert (rows["drop"]["status"], rows["drop"]["score"]) == ("error", 0.0)
    assert "RemoteProtocolError" in rows["drop"]["detail"] or "ReadError" in rows["drop"]["detail"]
    assert (rows["fine"]["status"], rows["fine"]["score"]) == ("completed", 1.0)
    assert [row["id"] for row in receipt["rows"]] == ["cut", "drop", "fine"]
    assert receipt["totals"]["accuracy"] == 0.6667 and receipt["totals"]["refused"] == 1


def test_a_refused_token_stops_the_run_before_any_turn(
    gateway: tuple[str, FakeGateway], tmp_path: Path
) -> None:
    url, fake = gateway
    with pytest.raises(TurnRefused, match="401 auth_required"):
        run_dataset(
            dataset(tmp_path),
            Target(url, "wrong", None, url),
            concurrency=1,
            default_metric=Metric(name="exact"),
        )
    assert fake.sessions == {}
