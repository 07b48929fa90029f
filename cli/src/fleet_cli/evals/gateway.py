"""One dataset row as a real Turn, through a gateway's public API: a session of its own, its
attachments uploaded, the Turn posted and its stream read to the end, then the Run and the
answer read back. Nothing here knows the worker: any deployment (or an embedded stack) serves."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from fleet_cli.evals.dataset import Dataset, Row

RETRIES = 5  # a 429 or 503 is retried with the same Idempotency-Key after its Retry-After
MAX_RETRY_AFTER_SECONDS = 30.0


class TurnRefused(RuntimeError):
    """The gateway refused the row's Turn (its error envelope's code and message)."""


@dataclass(frozen=True)
class Answered:
    run_id: str
    session_id: str
    answer: str
    seconds: float  # the POST to the end of its stream
    run: dict[str, Any]  # GET /api/runs/{id}: status, failure_code, usage, model


class Gateway:
    def __init__(self, url: str, token: str | None, turn_timeout: float) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        timeout = httpx.Timeout(60.0, read=turn_timeout)
        self.client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)

    def close(self) -> None:
        self.client.close()

    def skills(self) -> list[dict[str, Any]]:
        """The deployment's skill cards and their versions, for the receipt."""
        response = self.client.get("/api/skills")
        if response.status_code != 200:
            return []
        return [{"id": s["id"], "version": s["version"]} for s in response.json().get("items", [])]

    def answer(self, dataset: Dataset, row: Row, label: str) -> Answered:
        session = self.call("POST", "/api/sessions", json={"title": f"eval {label} {row.id}"[:200]})
        attachment_ids = [self.upload(dataset.attachment(name)) for name in row.attachments]
        body = {"text": row.request, "attachment_ids": attachment_ids}
        key = f"eval-{uuid.uuid4().hex}"
        started = time.perf_counter()
        run_id = self.turn(session["id"], body, key)
        seconds = time.perf_counter() - started
        run = self.call("GET", f"/api/runs/{run_id}")
        return Answered(run_id, session["id"], self.last_answer(session["id"]), seconds, run)

    def turn(self, session_id: str, body: dict[str, Any], key: str) -> str:
        """Post the Turn and read its stream to `[DONE]`; the Run's id."""
        for attempt in range(RETRIES + 1):
            with self.client.stream(
                "POST", f"/api/sessions/{session_id}/turns", json=body, headers={"Idempotency-Key": key}
            ) as response:
                if response.status_code == 200:
                    run_id = response.headers.get("x-fleet-run-id")
                    for _ in response.iter_bytes():
                        pass
                    if run_id:
                        return str(run_id)
                    raise TurnRefused("the gateway's stream named no Run (x-fleet-run-id)")
                response.read()
                if response.status_code in (429, 503) and attempt < RETRIES:
                    time.sleep(retry_after(response))
                    continue
                raise TurnRefused(refusal(response))
        raise AssertionError("unreachable")

    def upload(self, path: Path) -> str:
        with path.open("rb") as data:
            files = {"attachment": (path.name, data)}
            response = self.client.post(
                "/api/attachments", files=files, headers={"X-Requested-With": "fleet-eval"}
            )
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
