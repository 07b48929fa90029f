"""A session's cost is the sum of its Runs' `usage.cost_usd`, read from the JSON column on both
databases: null while no Run had a priced model, and a Run without a price adds nothing."""

from __future__ import annotations

from sqlalchemy import update

from fleet_shared.db import queries, runs
from fleet_shared.db.models import Run
from tests.integration.harness import Harness

ROOT_SUBMIT = {"lm": "root", "reasoning": "done", "code": "SUBMIT(answer='ok')"}


async def test_a_sessions_cost_sums_its_priced_runs(harness_factory) -> None:  # type: ignore[no-untyped-def]
    harness: Harness = harness_factory(ROOT_SUBMIT, ROOT_SUBMIT, ROOT_SUBMIT)
    first = await harness.submit()
    await harness.work()
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, first)
        assert run is not None and run.usage is not None
        session_id, usage = run.session_id, run.usage
    assert "cost_usd" not in usage  # the scripted LM has no price
    second = await harness.submit(session_id=session_id, key="k2")
    await harness.work()
    elsewhere = await harness.submit(key="k3")  # another session's cost is not this one's
    await harness.work()
    async with harness.db_sessions() as db:
        assert await runs.session_cost_usd(db, session_id) is None
        for run_id, cost in ((first, 0.25), (elsewhere, 7.0)):
            await db.execute(update(Run).where(Run.id == run_id).values(usage={**usage, "cost_usd": cost}))
        await db.commit()
        assert await runs.session_cost_usd(db, session_id) == 0.25  # the unpriced second adds nothing
        await db.execute(update(Run).where(Run.id == second).values(usage={**usage, "cost_usd": 0.5}))
        await db.commit()
        assert await runs.session_cost_usd(db, session_id) == 0.75
