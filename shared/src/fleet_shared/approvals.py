"""A cell's approval as both sides see it in Redis: the worker waiting on it sets the key
`pending` (fleet_worker.approvals); a gateway records the first decision (decide), atomically,
so two people deciding at once, or a decision racing the timeout, leave exactly one outcome."""

from __future__ import annotations

from typing import Literal

import msgspec
from redis.asyncio import Redis

from fleet_shared import redis_keys

PENDING, TIMED_OUT = "pending", "timed_out"
Recorded = Literal["recorded", "unknown", "already_decided"]


class ApprovalDecision(msgspec.Struct, frozen=True):
    decision: Literal["approve", "deny"]
    note: str | None = None
    by: str | None = None  # the user who decided


# KEYS: the approval key; ARGV: the pending marker, the decision. 1: recorded (or this very
# decision was, by a retry of the same call); 0: no such key (never asked, or long past its
# wait); 2: decided otherwise already, or timed out.
DECIDE_SCRIPT = """
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
if v == ARGV[2] then return 1 end
if v ~= ARGV[1] then return 2 end
redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL')
return 1
"""
# The worker's side of the same race: `timed_out` only over `pending`. KEYS: the approval key;
# ARGV: the pending marker, the timed-out marker. The value it found (nil: no key).
TIME_OUT_SCRIPT = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL') end
return v
"""


async def decide(redis: Redis, run_id: str, approval_id: str, decision: ApprovalDecision) -> Recorded:
    key = redis_keys.run_approval(run_id, approval_id)
    encoded = msgspec.json.encode(decision).decode()
    result = int(await redis.eval(DECIDE_SCRIPT, 1, key, PENDING, encoded))  # type: ignore[misc]
    return "recorded" if result == 1 else "unknown" if result == 0 else "already_decided"
