"""A small reader for the Turn stream's SSE frames, for assertions."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class TurnStream:
    status: int
    headers: httpx.Headers
    raw: bytes
    frames: list[tuple[str | None, str]]  # (id, data)

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(data) for _id, data in self.frames if data != "[DONE]"]

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [c for c in self.chunks if c["type"] == kind]

    @property
    def types(self) -> list[str]:
        return [c["type"] for c in self.chunks]


def parse_frames(raw: bytes) -> list[tuple[str | None, str]]:
    frames: list[tuple[str | None, str]] = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        event_id: str | None = None
        data = None
        for line in block.split("\n"):
            field, _, value = line.partition(": ")
            if field == "id":
                event_id = value
            elif field == "data":
                assert data is None, f"one data line per frame: {block!r}"
                data = value
            else:
                raise AssertionError(f"unexpected SSE line {line!r}")
        assert data is not None, block
        frames.append((event_id, data))
    return frames


def post_turn(client: httpx.Client, session_id: str, text: str, key: str, **body: Any) -> TurnStream:
    with client.stream(
        "POST",
        f"/api/sessions/{session_id}/turns",
        json={"text": text, **body},
        headers={"Idempotency-Key": key},
    ) as response:
        raw = response.read()
    is_stream = response.headers.get("content-type", "").startswith("text/event-stream")
    frames = parse_frames(raw) if is_stream else []
    return TurnStream(response.status_code, response.headers, raw, frames)
