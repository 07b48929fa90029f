"""Frame ids: what a Last-Event-ID names, and how frames carry their ids."""

from __future__ import annotations

import pytest

from fleet_gateway.frames import (
    START,
    WHOLE_EVENT,
    Position,
    content_frame,
    control_frame,
    parse_last_event_id,
)


@pytest.mark.parametrize(
    ("value", "position"),
    [
        ("0.0.1", START),
        ("0", Position(0, WHOLE_EVENT)),
        ("7", Position(7, WHOLE_EVENT)),
        ("7.0", Position(7, 0)),
        ("7.2", Position(7, 2)),
        ("7.2.9", Position(7, 2)),
        (" 12.3 ", Position(12, 3)),
        ("2147483647.0", Position(2**31 - 1, 0)),
    ],
)
def test_parse_last_event_id(value: str, position: Position) -> None:
    assert parse_last_event_id(value) == position


@pytest.mark.parametrize(
    "value",
    [
        "",
        "x",
        "-1",
        "1.-1",
        "1..2",
        "1.2.3.4",
        "1e3",
        "2147483648.0",
        "99999999999",
        "\uff11.\uff12",
        "1.2 3",
    ],
)
def test_malformed_ids_are_refused(value: str) -> None:
    assert parse_last_event_id(value) is None


def test_positions_order_as_the_stream_does() -> None:
    sent = [START, Position(1, 0), Position(2, 0), Position(2, 1), Position(2, 2), Position(10, 0)]
    assert sorted(sent) == sent
    assert Position(2, WHOLE_EVENT) > Position(2, 2) and Position(2, WHOLE_EVENT) < Position(3, 0)


def test_frames_carry_their_ids() -> None:
    assert (
        content_frame(Position(3, 1), {"type": "text-delta"}) == b'id: 3.1\ndata: {"type":"text-delta"}\n\n'
    )
    assert control_frame(Position(3, 1), 2, {"type": "start"}) == b'id: 3.1.2\ndata: {"type":"start"}\n\n'
