"""The worker's Turn lifecycle on a real arq worker (burst mode), real Redis, a real bwrap sandbox,
and both databases. The LM is the scripted LM: no provider is reachable here."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec

from fleet_shared import redis_keys
from fleet_shared.db import queries, runs
from fleet_shared.db.engine import create_engine, session_factory
from fleet_shared.event_log import Appended, RunLog, lease_token
from fleet_shared.events import CellOutput, RunCompleted, RunEvent, RunFailed
from fleet_worker.turn import run_turn
from tests.integration.harness import Harness


def settlement_of(run: Any, command: Any, events: list[RunEvent], failure_code: str | None = None) -> Any:
    """The settlement a worker would commit for `run` with these events."""
    from fleet_shared.run_state import RunCommand, RunStatus

    return runs.Settlement(
        run_id=run.id,
        session_id=run.session_id,
        attempt=run.attempt,
        current=RunStatus.RUNNING,
        command=command,
        sequence=run.user_sequence + 1,
        parts=[],
        turn_status="completed" if command is RunCommand.COMPLETE else "failed",
        events=events,
        failure_code=failure_code,
        failure_message=failure_code,
    )


ROOT_PRINT = {"lm": "root", "reasoning": "look", "code": "x = 21 * 2\nprint(x)"}
ROOT_SUBMIT = {"lm": "root", "reasoning": "done", "code": "SUBMIT(answer=str(x))"}


async def test_completed_turn_is_committed_and_logged(harness_factory) -> None:  # type: ignore[no-untyped-def]
    harness: Harness = harness_factory(ROOT_PRINT, ROOT_SUBMIT)
    run_id = await harness.submit()
    await harness.work()

    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
        assert run is not None
        assert (run.status, run.attempt, run.failure_code) == ("completed", 1, None)
        turns = await queries.list_turns(db, run.session_id, after_sequence=0, limit=10)
        committed = await queries.load_run_events(db, run_id)
    assert [t.role for t in turns] == ["user", "assistant"]
    assert [p["text"] for p in turns[1].parts if p["type"] == "text"] == ["42"]
    logged = await harness.events(run_id)
    assert logged == committed  # the Redis log and the DB agree, seq for seq
    assert [e.seq for e in logged] == list(range(1, len(logged) + 1))
    assert isinstance(logged[-1], RunCompleted)
    outputs = [e for e in logged if isinstance(e, CellOutput)]
    assert outputs[0].stdout == "42\n"
    assert run.usage is not None and run.usage["iterations"] == 2


async def test_duplicate_job_does_nothing(harness_factory) -> None:  # type: ignore[no-untyped-def]
    harness: Harness = harness_factory(ROOT_PRINT, ROOT_SUBMIT)
    run_id = await harness.submit()
    await harness.work()
    before = await harness.events(run_id)
    engine = create_engine(harness.settings.database_url)
    deps = SimpleNamespace(settings=harness.settings, db_sessions=session_factory(engine), manifests=None)
    assert await run_turn({"deps": deps, "job_try": 2}, run_id) == "duplicate"
    await engine.dispose()
    assert await harness.events(run_id) == before


async def test_exhausted_script_fails_the_run_with_a_code(harness_factory) -> None:  # type: ignore[no-untyped-def]
    harness: Harness = harness_factory(ROOT_PRINT)  # never submits, then runs out
    run_id = await harness.submit()
    await harness.work()
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
        assert run is not None
        turns = await queries.list_turns(db, run.session_id, after_sequence=0, limit=10)
    assert (run.status, run.failure_code) == ("failed", "script_exhausted")
    assert "no more `root` lines" in (run.failure_message or "")
    assert turns[-1].role == "assistant" and turns[-1].status == "failed"
    logged = await harness.events(run_id)
    assert isinstance(logged[-1], RunFailed) and logged[-1].code == "script_exhausted"


async def test_turn_timeout_ends_as_timed_out(harness_factory) -> None:  # type: ignore[no-untyped-def]
    slow = {"lm": "root", "reasoning": "wait", "code": "print(1)", "delay_s": 30}
    harness: Harness = harness_factory(slow, ROOT_SUBMIT, turn_timeout=1)
    run_id = await harness.submit()
    await harness.work()
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
    assert run is not None and (run.status, run.failure_code) == ("timed_out", "turn_timeout")
    assert run.finished_at is not None and run.started_at is not None
    logged = await harness.events(run_id)
    assert isinstance(logged[-1], RunFailed) and logged[-1].code == "turn_timeout"


async def test_runaway_cell_is_killed_and_the_turn_recovers(harness_factory) -> None:  # type: ignore[no-untyped-def]
    spin = {"lm": "root", "reasoning": "loop", "code": "x = 1\nwhile True:\n    pass"}
    recover = {"lm": "root", "reasoning": "retry", "code": "x = 5\nSUBMIT(answer=str(x))"}
    harness: Harness = harness_factory(spin, recover)
    run_id = await harness.submit()
    await harness.work()
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
    assert run is not None and run.status == "completed"
    failed_cells = [e for e in await harness.events(run_id) if isinstance(e, CellOutput) and e.error]
    assert len(failed_cells) == 1 and "exceeded the 2s timeout" in (failed_cells[0].error or "")


async def test_a_commit_whose_acknowledgement_was_lost_is_recognised(harness_factory) -> None:  # type: ignore[no-untyped-def]
    """The retry after a lost COMMIT acknowledgement finds its own commit, not a foreign one."""
    from fleet_shared.run_state import RunCommand
    from fleet_worker.settlement import commit_once_on

    harness: Harness = harness_factory(ROOT_PRINT, ROOT_SUBMIT)
    run_id = await harness.submit()
    await harness.work()
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
        assert run is not None
        # The retry carries the same events as the commit whose acknowledgement it missed.
        mine = settlement_of(run, RunCommand.COMPLETE, await queries.load_run_events(db, run_id))
        assert await db.run_sync(commit_once_on, mine) is True
        assert (
            await db.run_sync(commit_once_on, msgspec.structs.replace(mine, attempt=run.attempt + 1)) is False
        )
        assert (
            await db.run_sync(commit_once_on, msgspec.structs.replace(mine, command=RunCommand.FAIL)) is False
        )
        turns = await queries.list_turns(db, run.session_id, after_sequence=0, limit=10)
    assert len(turns) == 2  # nothing was written twice


async def test_sweeper_takes_over_and_settles_runs_whose_lease_lapsed(harness_factory) -> None:  # type: ignore[no-untyped-def]
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import update

    from fleet_shared.db.models import Run
    from fleet_shared.events import Reasoning

    harness: Harness = harness_factory(ROOT_PRINT, ROOT_SUBMIT)
    lost, leased, fresh = [await harness.submit(f"run {i}") for i in range(3)]
    long_ago = datetime.now(UTC) - timedelta(minutes=5)
    async with harness.db_sessions() as db:
        for run_id in (lost, leased, fresh):
            assert await db.run_sync(runs.start_run_on, run_id) is not None
        await db.execute(update(Run).where(Run.id.in_([lost, leased])).values(started_at=long_ago))
        await db.commit()
    # The lost Run's worker had published two events before it died.
    await harness.log_as_dead_worker(
        lost,
        1,
        Reasoning(run_id=lost, seq=1, part_id="r", text="hm"),
        Reasoning(run_id=lost, seq=2, part_id="r2", text="hmm"),
    )
    await harness.redis.set(redis_keys.run_lease(leased), "alive", px=60_000)

    sweeper = harness.sweeper()
    assert await sweeper.settle_lost_runs() >= 1  # other tests' abandoned Runs may be reaped too
    assert await sweeper.settle_lost_runs() == 0  # idempotent

    async with harness.db_sessions() as db:
        statuses = {r: (await queries.get_run(db, r)).status for r in (lost, leased, fresh)}  # type: ignore[union-attr]
        run = await queries.get_run(db, lost)
        assert run is not None
        turns = await queries.list_turns(db, run.session_id, after_sequence=0, limit=10)
    assert statuses == {lost: "failed", leased: "running", fresh: "running"}
    assert (run.failure_code, run.attempt) == ("worker_lost", 2)  # the take-over was a claim
    assert turns[-1].role == "assistant" and turns[-1].status == "failed"
    assert [p["text"] for p in turns[-1].parts if p["type"] == "reasoning"] == ["hm", "hmm"]
    logged = await harness.events(lost)
    assert [e.seq for e in logged] == [1, 2, 3]
    assert isinstance(logged[-1], RunFailed) and logged[-1].code == "worker_lost"
    assert not await harness.redis.exists(redis_keys.run_lease(lost))  # the sweeper let go

    # The "lost" worker was only stalled: its late commit and its late events are refused.
    from fleet_shared.run_state import RunCommand
    from fleet_worker.settlement import commit_once_on

    zombie_end = RunFailed(run_id=lost, seq=4, code="lm_error", message="late")
    zombie = settlement_of(run, RunCommand.FAIL, [zombie_end], failure_code="lm_error")
    zombie = msgspec.structs.replace(zombie, attempt=1)
    async with harness.db_sessions() as db:
        assert await db.run_sync(commit_once_on, zombie) is False
    result = await RunLog(harness.redis).append(zombie_end, lease_token(1, "dead-worker"))
    assert result.status is Appended.FENCED
    assert [e.seq for e in await harness.events(lost)] == [1, 2, 3]


async def test_reaper_requeues_a_lost_job_and_gives_up_on_an_ancient_one(harness_factory) -> None:  # type: ignore[no-untyped-def]
    """The gateway died between its commit and its enqueue (or Redis lost the queue)."""
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import update

    from fleet_shared.db.models import Run

    harness: Harness = harness_factory(ROOT_PRINT, ROOT_SUBMIT)
    lost = await harness.submit("lost", enqueue=False)
    ancient = await harness.submit("ancient", enqueue=False)
    waiting = await harness.submit("waiting")  # its job is in the queue: leave it alone
    failed_early = await harness.submit("failed early", enqueue=False)
    # Its job ran once and failed before claiming the Run (say, the DB was down): arq kept a result.
    await harness.redis.set(f"arq:result:{failed_early}", b"x", ex=60)
    now = datetime.now(UTC)
    async with harness.db_sessions() as db:
        await db.execute(
            update(Run)
            .where(Run.id.in_([lost, waiting, failed_early]))
            .values(created_at=now - timedelta(minutes=1))
        )
        await db.execute(update(Run).where(Run.id == ancient).values(created_at=now - timedelta(hours=1)))
        await db.commit()
    assert await harness.sweeper().requeue_lost_jobs() >= 3
    assert await harness.jobs().pending(lost) and await harness.jobs().pending(waiting)
    await harness.work()  # the re-enqueued job really runs
    async with harness.db_sessions() as db:
        runs = {r: await queries.get_run(db, r) for r in (lost, ancient, waiting, failed_early)}
    assert runs[lost].status == "completed"  # type: ignore[union-attr]
    assert runs[waiting].status == "completed"  # type: ignore[union-attr]
    assert runs[failed_early].status == "completed"  # type: ignore[union-attr]
    assert (runs[ancient].status, runs[ancient].failure_code) == ("failed", "enqueue_lost")  # type: ignore[union-attr]
    logged = await harness.events(ancient)
    assert isinstance(logged[-1], RunFailed) and logged[-1].code == "enqueue_lost"


async def test_a_crowd_of_healthy_runs_does_not_hide_a_lost_one(harness_factory) -> None:  # type: ignore[no-untyped-def]
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import update

    from fleet_shared.db.models import Run

    harness: Harness = harness_factory(ROOT_PRINT, ROOT_SUBMIT)
    healthy = [await harness.submit(f"healthy {i}", enqueue=False) for i in range(60)]
    lost = await harness.submit("lost", enqueue=False)
    now = datetime.now(UTC)
    async with harness.db_sessions() as db:
        for run_id in [*healthy, lost]:
            assert await db.run_sync(runs.start_run_on, run_id) is not None
        # The healthy ones are older, so they would fill any first page of candidates.
        await db.execute(update(Run).where(Run.id.in_(healthy)).values(started_at=now - timedelta(hours=2)))
        await db.execute(update(Run).where(Run.id == lost).values(started_at=now - timedelta(minutes=5)))
        await db.commit()
    for run_id in healthy:
        await harness.redis.set(redis_keys.run_lease(run_id), "alive", px=60_000)
    await harness.sweeper().settle_lost_runs()
    async with harness.db_sessions() as db:
        assert (await queries.get_run(db, lost)).status == "failed"  # type: ignore[union-attr]
        statuses = {(await queries.get_run(db, r)).status for r in healthy}  # type: ignore[union-attr]
    assert statuses == {"running"}
    for run_id in healthy:  # leave nothing running for later tests' reapers to trip over
        await harness.redis.delete(redis_keys.run_lease(run_id))


async def test_a_worker_publishes_its_committed_ending_after_redis_lost_everything(harness_factory) -> None:  # type: ignore[no-untyped-def]
    """Redis restarts between the commit and the terminal's publication: the worker takes its
    lease back (the DB names its attempt, though the Run is now terminal) and refills the log."""
    import time
    from contextlib import AsyncExitStack

    from fleet_shared.events import StatusChanged
    from fleet_shared.redis_conn import listener
    from fleet_shared.run_state import RunCommand, RunStatus
    from fleet_shared.transcript import fold_parts
    from fleet_worker.cancels import CancelListener
    from fleet_worker.turn import Claim, hold

    harness: Harness = harness_factory(ROOT_PRINT, ROOT_SUBMIT)
    run_id = await harness.submit(enqueue=False)
    async with harness.db_sessions() as db:
        started = await db.run_sync(runs.start_run_on, run_id)
        assert started is not None
        run = started.run
    listen = listener(harness.settings.redis_url)
    deps = SimpleNamespace(
        settings=harness.settings,
        db_sessions=harness.db_sessions,
        runlog=RunLog(harness.redis),
        cancels=CancelListener(harness.redis, listen),
        worker_id="w1",
    )
    claim = Claim(run_id, run.session_id, "ws", run.attempt, run.user_sequence, time.monotonic())
    async with AsyncExitStack() as cleanup:
        turn = await hold(deps, claim, cleanup)  # type: ignore[arg-type]
        turn.sink.emit(StatusChanged(run_id=run_id, phase="execution"))
        terminal = turn.sink.stamp_terminal(RunCompleted(run_id=run_id, duration_ms=1))
        async with harness.db_sessions() as db:
            settlement = runs.Settlement(
                run_id=run_id,
                session_id=run.session_id,
                attempt=run.attempt,
                current=RunStatus.RUNNING,
                command=RunCommand.COMPLETE,
                sequence=run.user_sequence + 1,
                parts=fold_parts(turn.sink.events),
                turn_status="completed",
                events=turn.sink.events,
            )
            assert await runs.commit_settlement(db, settlement)
        # Redis loses the lease and the log (a restart) before the terminal goes out.
        await harness.redis.delete(redis_keys.run_lease(run_id), redis_keys.run_events(run_id))
        assert await turn.sink.finish(within=10)
    await listen.aclose()
    logged = await harness.events(run_id)
    assert [e.seq for e in logged] == [1, 2] and logged[-1] == terminal


async def test_a_turn_out_of_iterations_ends_with_the_extracted_answer_and_says_so(harness_factory) -> None:  # type: ignore[no-untyped-def]
    """`rlm.max_iters` used up without SUBMIT: DSPy's extract fallback answers (with the scripted
    LM, the next root line's reasoning), a `max_iters` warning comes first, the Turn completes."""
    from fleet_shared.events import Answer, RunWarning

    steps = [{"lm": "root", "reasoning": f"step {i}", "code": f"x{i} = {i}"} for i in range(2)]
    extract = {"lm": "root", "reasoning": "the best answer so far", "code": "unused"}
    harness: Harness = harness_factory(*steps, extract, rlm={"max_iters": 2})
    run_id = await harness.submit()
    await harness.work()
    events = await harness.events(run_id)
    kinds = [type(e).__name__ for e in events]
    warnings = [e for e in events if isinstance(e, RunWarning)]
    answers = [e for e in events if isinstance(e, Answer)]
    assert [w.code for w in warnings] == ["max_iters"] and "rlm.max_iters" in warnings[0].message
    assert [a.text for a in answers] == ["the best answer so far"]
    assert kinds.index("RunWarning") < kinds.index("Answer") and kinds[-1] == "RunCompleted"
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
        assert run is not None and run.status == "completed"
        turns = await queries.list_turns(db, run.session_id, after_sequence=0, limit=10)
    assert {"type": "data-warning", "data": {"message": warnings[0].message, "code": "max_iters"}} in turns[
        1
    ].parts
