"""One dataset row as a real Turn, through a gateway's public API: a session of its own, its
attachments uploaded, the Turn posted and its stream read to `[DONE]` (a stream the gateway ends
early, at `stream_max_seconds` or a restart, is followed by reading the Run until it ends), then
the Run and the answer read back. Nothing here knows the worker: any deployment serves."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from fleet_cli.evals.dataset import Dataset, Row
from fleet_shared.run_state import RunStatus, is_terminal

RETRIED_STATUSES = (429, 502, 503, 504)  # retried with the same Idempotency-Key
RETRIES = 5
MAX_RETRY_AFTER_SECONDS = 30.0
POLL_SECONDS = 1.0
DONE = b"data: [DONE]"


class TurnRefused(RuntimeError):
    """The gateway refused the row's Turn (its error envelope's code and message)."""


@dataclass(frozen=True)
class Answered:
    run_id: str
    session_id: str
    answer: str
    seconds: float  # the POST to the Run's end
    run: dict[str, Any]  # GET /api/runs/{id}: status, failure_code, usage, model, program version


class Gateway:
    def __init__(self, url: str, token: str | None, turn_timeout: float, connections: int = 10) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.turn_timeout = turn_timeout
        self.client = httpx.Client(
            base_url=url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(60.0),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        )

    def close(self) -> None:
        self.client.close()

    def check_access(self) -> None:
        """One cheap read before any Turn: a missing or refused token says so at once."""
        response = self.client.get("/api/sessions", params={"limit": 1})
        if response.status_code != 200:
            raise TurnRefused(f"GET /api/sessions: {refusal(response)}")

    def skills(self) -> list[dict[str, Any]]:
        """The deployment's skill cards and their versions, for the receipt."""
        response = self.client.get("/api/skills")
        if response.status_code != 200:
            return []
        return [{"id": s["id"], "version": s["version"]} for s in response.json().get("items", [])]

    def answer(self, dataset: Dataset, row: Row, label: str, program_version: str | None = None) -> Answered:
        session = self.call("POST", "/api/sessions", json={"title": f"eval {label} {row.id}"[:200]})
        body: dict[str, Any] = {
            "text": row.request,
            "attachment_ids": [self.upload(dataset.attachment(name)) for name in row.attachments],
        }
        if program_version is not None:
            body["program_version"] = program_version
        started = time.perf_counter()
        deadline = time.monotonic() + self.turn_timeout
        run_id, done = self.turn(session["id"], body, f"eval-{uuid.uuid4().hex}", deadline)
        run = self.call("GET", f"/api/runs/{run_id}") if done else self.wait_for_end(run_id, deadline)
        seconds = time.perf_counter() - started
        return Answered(run_id, session["id"], self.last_answer(session["id"]), seconds, run)

    def turn(self, session_id: str, body: dict[str, Any], key: str, deadline: float) -> tuple[str, bool]:
        """Post the Turn and read its stream: the Run's id, and whether the stream reached `[DONE]`
        before the deadline (else the Run is read until it ends)."""
        for attempt in range(RETRIES + 1):
            with self.client.stream(
                "POST", f"/api/sessions/{session_id}/turns", json=body, headers={"Idempotency-Key": key}
            ) as response:
                if response.status_code == 200:
                    run_id = response.headers.get("x-fleet-run-id")
                    if not run_id:
                        raise TurnRefused("the gateway's stream named no Run (x-fleet-run-id)")
                    return str(run_id), read_to_done(response, deadline)
                response.read()
                if response.status_code in RETRIED_STATUSES and attempt < RETRIES:
                    time.sleep(retry_after(response))
                    continue
                raise TurnRefused(refusal(response))
        raise AssertionError("unreachable")

    def wait_for_end(self, run_id: str, deadline: float) -> dict[str, Any]:
        """The Run once it has ended; past the deadline it is cancelled (and read once it ends)."""
        cancelled = False
        while True:
            run = self.call("GET", f"/api/runs/{run_id}")
            if is_terminal(RunStatus(run["status"])):
                return run
            if time.monotonic() > deadline and not cancelled:
                self.cancel(run_id)
                cancelled = True
            time.sleep(POLL_SECONDS)

    def cancel(self, run_id: str) -> None:
        """Best effort: the Run stops spending; its status then says it was cancelled."""
        try:
            self.client.put(f"/api/runs/{run_id}/cancellation")
        except httpx.HTTPError:
            return

    def upload(self, path: Path) -> str:
        with path.open("rb") as data:
            files = {"attachment": (path.name, data)}
            headers = {"X-Requested-With": "fleet-eval"}
            response = self.client.post("/api/attachments", files=files, headers=headers)
        if response.status_code != 201:
            raise TurnRefused(f"uploading {path.name}: {refusal(response)}")
        return str(response.json()["id"])

    def last_answer(self, session_id: str) -> str:
        items = self.call("GET", f"/api/sessions/{session_id}/turns").get("items", [])
        for item in reversed(items):
            if item.get("role") == "assistant":
                return "".join(p.get("text", "") for p in item.get("parts", []) if p.get("type") == "text")
        return ""

    def call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = self.client.request(method, path, **kwargs)
        if response.status_code not in (200, 201):
            raise TurnRefused(f"{method} {path}: {refusal(response)}")
        found: dict[str, Any] = response.json()
        return found


def read_to_done(response: httpx.Response, deadline: float) -> bool:
    """Read the stream until `[DONE]` (True), its end without it, or the deadline (False)."""
    tail = b""
    for chunk in response.iter_bytes():
        tail = (tail + chunk)[-64:]
        if DONE in tail:
            return True
        if time.monotonic() > deadline:
            return False
    return False


def refusal(response: httpx.Response) -> str:
    try:
        error = response.json()  # the envelope: {code, message}
        return f"{response.status_code} {error.get('code')}: {error.get('message')}"
    except (ValueError, AttributeError):
        return f"{response.status_code}: {response.text[:200]}"


def retry_after(response: httpx.Response) -> float:
    try:
        return min(MAX_RETRY_AFTER_SECONDS, max(0.5, float(response.headers.get("retry-after", "2"))))
    except ValueError:
        return 2.0
