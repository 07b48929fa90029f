"""SSE frames and their ids: the positions a client resumes from (docs/api.md, "Frame ids").

- A content frame carries one chunk of one Runtime Event: id `<seq>.<k>`, the k-th chunk (from
  0) of the event with that seq. Every stream of a Run gives the same chunk the same id.
- A control frame (the `start` of a stream, a heartbeat) carries no Run content: id
  `<seq>.<k>.<n>`, the n-th control frame (from 1) this connection sent since content frame
  `<seq>.<k>` (`0.0` before any).
- `Last-Event-ID: <seq>.<k>[.<n>]` resumes after content frame `<seq>.<k>`; a bare `<seq>` after
  every chunk of event `<seq>`. Ids increase within a connection in (seq, k, n) order.
- `data: [DONE]` has no id: it only ends the connection.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import msgspec

CHUNK_ENCODER = msgspec.json.Encoder()
DONE_FRAME = b"data: [DONE]\n\n"
WHOLE_EVENT = 2**31 - 1  # the chunk index a bare `<seq>` stands for: after all of the event
LAST_EVENT_ID = re.compile(r"^([0-9]{1,10})(?:\.([0-9]{1,10})(?:\.[0-9]{1,10})?)?$")


class Position(NamedTuple):
    """A place in a Run's stream: after chunk `chunk` of event `seq`. Tuples order it."""

    seq: int
    chunk: int


START = Position(0, 0)  # before event 1


def parse_last_event_id(value: str) -> Position | None:
    """The position a Last-Event-ID names, or None when it is not one of ours."""
    match = LAST_EVENT_ID.match(value.strip())
    if match is None:
        return None
    seq = int(match[1])
    chunk = int(match[2]) if match[2] is not None else WHOLE_EVENT
    if seq > WHOLE_EVENT or chunk > WHOLE_EVENT:
        return None
    return Position(seq, chunk)


def content_frame(position: Position, chunk: dict[str, Any]) -> bytes:
    return b"id: %d.%d\ndata: %s\n\n" % (position.seq, position.chunk, CHUNK_ENCODER.encode(chunk))


def control_frame(position: Position, count: int, chunk: dict[str, Any]) -> bytes:
    return b"id: %d.%d.%d\ndata: %s\n\n" % (position.seq, position.chunk, count, CHUNK_ENCODER.encode(chunk))
