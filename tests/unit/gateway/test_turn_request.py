"""A Turn request's fingerprint (what an Idempotency-Key is bound to): the text, attachments and
skills, in canonical bytes; the follow-up strategy is not part of it, and the bytes are those
keys were bound to before it existed."""

from __future__ import annotations

import uuid

import msgspec
import pytest

from fleet_gateway.schemas import SkillSelection, TurnRequest


def test_the_fingerprint_is_the_requests_canonical_bytes_whatever_its_follow_up_strategy() -> None:
    attached = [uuid.UUID(int=1)]
    skills = [SkillSelection(id="csv", expected_version="2")]
    for multitask in ("reject", "enqueue", "interrupt"):
        request = TurnRequest(
            text="hi", attachment_ids=attached, skill_selections=skills, multitask=multitask
        )
        assert request.fingerprint_bytes() == (
            b'{"attachment_ids":["00000000-0000-0000-0000-000000000001"],'
            b'"skill_selections":[{"expected_version":"1","id":"csv"}],"text":"hi"}'.replace(b'"1"', b'"2"')
        )
    reordered = msgspec.json.decode(b'{"text":"hi","multitask":"interrupt"}', type=TurnRequest)
    assert reordered.fingerprint_bytes() == b'{"attachment_ids":[],"skill_selections":[],"text":"hi"}'


def test_an_unknown_follow_up_strategy_is_refused() -> None:
    with pytest.raises(msgspec.ValidationError, match="multitask"):
        msgspec.json.decode(b'{"text":"hi","multitask":"queue"}', type=TurnRequest)
