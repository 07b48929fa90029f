"""`quotas.active_turns` in the claim's own transaction, on SQLite and PostgreSQL: concurrent
claims of one tenant get exactly the limit, and other tenants are not counted."""

from __future__ import annotations

import asyncio

from fleet_shared.db import claims, queries
from fleet_shared.db.engine import create_engine, session_factory
from fleet_shared.tenancy import Principal

LIMIT, BURST = 3, 50


async def test_concurrent_claims_get_exactly_the_limit(database_url: str) -> None:
    engine = create_engine(database_url)
    busy, other = Principal("busy", "u"), Principal("other", "u")
    try:
        async with session_factory(engine)() as db:
            ids = [(await queries.create_session(db, "q", busy)).id for _ in range(BURST)]
            elsewhere = (await queries.create_session(db, "q", other)).id

        async def claim(session_id: str, caller: Principal) -> claims.Claimed | claims.ClaimRefused:
            return await claims.claim_turn(
                engine, caller=caller, active_limit=LIMIT, session_id=session_id,
                idempotency_key="k", fingerprint="f", text="hi", model="m",
            )  # fmt: skip

        outcomes = await asyncio.gather(*(claim(session_id, busy) for session_id in ids))
        claimed = [o for o in outcomes if isinstance(o, claims.Claimed) and o.created]
        refused = [o for o in outcomes if o == claims.ClaimRefused("active_turns_quota")]
        assert (len(claimed), len(refused)) == (LIMIT, BURST - LIMIT)
        assert isinstance(await claim(elsewhere, other), claims.Claimed)  # its own count
        again = await claim(next(i for i, o in zip(ids, outcomes, strict=True) if o in refused), busy)
        assert again == claims.ClaimRefused("active_turns_quota")  # still at the limit
        replay = await claim(claimed[0].run.session_id, busy)
        assert isinstance(replay, claims.Claimed) and not replay.created  # a replay is not a new Turn
    finally:
        await engine.dispose()
