"""The RLM at depth, through a real arq worker, Redis, the DB and bwrap sandboxes: the one shared
LM budget, `llm_query_batched`, and `rlm_query` children (docs/rlm.md)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY

from fleet_shared import redis_keys
from fleet_shared.db import queries
from fleet_shared.event_log import control_channel
from fleet_shared.events import (
    Answer,
    CellOutput,
    ChildProgress,
    LMQueryStarted,
    RunCancelled,
    RunCompleted,
    RunEvent,
    RunWarning,
    Usage,
)
from tests.integration.harness import Harness

RECURSIVE = {"recursion": True}


def root(code: str, reasoning: str = "step", **extra: Any) -> dict[str, Any]:
    return {"lm": "root", "reasoning": reasoning, "code": code, **extra}


def child(code: str, reasoning: str = "child step", **extra: Any) -> dict[str, Any]:
    return {"lm": "child", "reasoning": reasoning, "code": code, **extra}


def sub(text: str) -> dict[str, Any]:
    return {"lm": "sub", "text": text}


def of(events: list[RunEvent], kind: type) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


def scratch_folders(harness: Harness) -> list[Path]:
    workspaces = harness.settings.data_dir / "workspaces"
    return sorted(workspaces.glob("scratch-*")) if workspaces.exists() else []


async def test_one_budget_refuses_sub_calls_once_the_root_used_its_share(harness_factory) -> None:  # type: ignore[no-untyped-def]
    """max_llm_calls = 4: the first action (1) and a batch of 3 use it all, so the next
    llm_query and batch are refused inside the cell (a RuntimeError it catches), with one
    `llm_budget_exhausted` warning; the RLM carries on and completes."""
    harness: Harness = harness_factory(
        root("answers = llm_query_batched(['a', 'b', 'c'])\nprint(answers)"),
        root(
            "try:\n    llm_query('one more')\nexcept RuntimeError as exc:\n    first = str(exc)\n"
            "try:\n    llm_query_batched(['x', 'y'])\nexcept RuntimeError as exc:\n    second = str(exc)\n"
            "print(first)"
        ),
        root("SUBMIT(answer=' '.join(sorted(answers)) + ' | ' + str('budget exhausted' in first))"),
        sub("A"),
        sub("B"),
        sub("C"),
        sub("never asked"),
        rlm={"max_llm_calls": 4},
    )
    run_id = await harness.submit()
    await harness.work()
    events = await harness.events(run_id)
    assert isinstance(events[-1], RunCompleted)
    assert [a.text for a in of(events, Answer)] == ["A B C | True"]
    warnings = of(events, RunWarning)
    assert [w.code for w in warnings] == ["llm_budget_exhausted"]
    started = of(events, LMQueryStarted)
    assert [(s.tool, s.prompt_count) for s in started] == [("llm_query_batched", 3)]
    refusal = next(c for c in of(events, CellOutput) if c.call_id == "cell-2")
    assert "LLM call budget exhausted: llm_query needs 1 call(s) but only 0" in refusal.stdout
    assert "rlm.max_llm_calls" in refusal.stdout


async def test_llm_query_batched_answers_in_prompt_order_as_one_tool_part(harness_factory) -> None:  # type: ignore[no-untyped-def]
    harness: Harness = harness_factory(
        root("got = llm_query_batched(['p1', 'p2', 'p3'])\nprint(len(got))"),
        root("SUBMIT(answer='|'.join(got))"),
        sub("first"),
        sub("second"),
        sub("third"),
        rlm={"batch_concurrency": 2},
    )
    run_id = await harness.submit()
    await harness.work()
    events = await harness.events(run_id)
    # The scripted LM hands out sub lines in call order; with 2 in flight the order of the
    # calls may differ from the prompts', so only the set is fixed.
    (answer,) = of(events, Answer)
    assert sorted(answer.text.split("|")) == ["first", "second", "third"]
    (started,) = of(events, LMQueryStarted)
    assert started.tool == "llm_query_batched" and started.prompt_count == 3 and started.prompt is None
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
        assert run is not None
        turns = await queries.list_turns(db, run.session_id, after_sequence=0, limit=10)
    (tool,) = [p for p in turns[1].parts if p.get("toolName") == "llm_query_batched"]
    assert tool["input"] == {"prompt_count": 3} and tool["state"] == "output-available"


async def test_rlm_query_runs_a_child_in_its_own_sandbox_and_reports_its_life(harness_factory) -> None:  # type: ignore[no-untyped-def]
    """The child sees only its task (a fresh, empty /workspace), cannot start children, uses
    the sub-LM from its slice, and its sandbox is gone afterwards; its tokens are the Turn's."""
    harness: Harness = harness_factory(
        root("open('memory/parent.txt', 'w').write('parent only')\nc = rlm_query('Count: a b c')\nprint(c)"),
        root("SUBMIT(answer=c)"),
        child(
            "import os\nseen = sorted(os.listdir('.'))\n"
            "try:\n    rlm_query('deeper')\n    deeper = 'recursed'\n"
            "except NameError:\n    deeper = 'no rlm_query'\n"
            "print(task, seen, deeper)"
        ),
        child("SUBMIT(answer=llm_query('count ' + task) + f' ({deeper}, {seen})')"),
        sub("three"),
        rlm=RECURSIVE,
    )
    run_id = await harness.submit()
    await harness.work()
    events = await harness.events(run_id)
    assert isinstance(events[-1], RunCompleted), events[-1]
    (answer,) = of(events, Answer)
    assert answer.text.startswith("three (no rlm_query, ")
    assert "parent.txt" not in answer.text and "memory" in answer.text  # its own empty layout
    progress = of(events, ChildProgress)
    assert [(p.child_id, p.state, p.cleanup_state) for p in progress] == [
        ("child-1", "started", "pending"),
        ("child-1", "completed", "released"),
    ]
    assert progress[0].task_label == "Count: a b c" and (progress[1].elapsed_ms or 0) >= 0
    started = of(events, LMQueryStarted)
    assert [(s.tool, s.prompt) for s in started] == [("rlm_query", "Count: a b c")]  # child steps stay quiet
    assert scratch_folders(harness) == []
    (usage,) = of(events, Usage)
    assert usage.iterations == 2
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
        assert run is not None
        turns = await queries.list_turns(db, run.session_id, after_sequence=0, limit=10)
    parts = [p for p in turns[1].parts if p["type"] == "data-child-progress"]
    assert parts == [
        {
            "type": "data-child-progress",
            "id": "child-1",
            "data": {
                "child_id": "child-1",
                "task_label": "Count: a b c",
                "state": "completed",
                "cleanup_state": "released",
                "elapsed_ms": progress[1].elapsed_ms,
            },
        }
    ]


async def test_a_child_that_spends_its_slice_fails_recoverably(harness_factory) -> None:  # type: ignore[no-untyped-def]
    """child_max_llm_calls = 2: a third child action is refused, the child ends, and the
    parent's cell gets an error it can handle; the unused budget is the parent's again."""
    harness: Harness = harness_factory(
        root(
            "try:\n    rlm_query('loop forever')\nexcept RuntimeError as exc:\n    why = str(exc)\nprint(why)"
        ),
        root("SUBMIT(answer=why + ' / ' + llm_query('still allowed'))"),
        child("x = 1"),
        child("x = 2"),
        child("SUBMIT(answer='never')"),
        sub("yes"),
        rlm={**RECURSIVE, "child_max_llm_calls": 2, "max_llm_calls": 6},
    )
    run_id = await harness.submit()
    await harness.work()
    events = await harness.events(run_id)
    assert isinstance(events[-1], RunCompleted), events[-1]
    (answer,) = of(events, Answer)
    assert "budget slice" in answer.text and answer.text.endswith(" / yes")
    progress = of(events, ChildProgress)
    assert [(p.state, p.cleanup_state) for p in progress] == [("started", "pending"), ("failed", "released")]
    assert scratch_folders(harness) == []


async def test_without_recursion_there_is_no_rlm_query(harness_factory) -> None:  # type: ignore[no-untyped-def]
    harness: Harness = harness_factory(
        root("try:\n    rlm_query('x')\n    r = 'yes'\nexcept NameError:\n    r = 'no'\nSUBMIT(answer=r)"),
    )
    run_id = await harness.submit()
    await harness.work()
    (answer,) = of(await harness.events(run_id), Answer)
    assert answer.text == "no"


async def test_cancel_during_a_child_reports_its_cleanup_before_the_abort(harness_factory) -> None:  # type: ignore[no-untyped-def]
    harness: Harness = harness_factory(
        root("c = rlm_query('wait a long time')"),
        child("import time\ntime.sleep(60)"),
        rlm=RECURSIVE,
    )
    run_id = await harness.submit()
    worker = asyncio.ensure_future(harness.work())
    try:
        async with asyncio.timeout(30):
            while not of(await harness.events(run_id), ChildProgress):  # noqa: ASYNC110 (polls Redis)
                await asyncio.sleep(0.05)
            await harness.redis.set(redis_keys.run_cancel(run_id), "1")
            await harness.redis.publish(control_channel(harness.redis), run_id)
            await worker
    finally:
        worker.cancel()
    events = await harness.events(run_id)
    assert isinstance(events[-1], RunCancelled)
    progress = of(events, ChildProgress)
    assert [(p.state, p.cleanup_state) for p in progress] == [
        ("started", "pending"),
        ("cancelled", "released"),
    ]
    assert events.index(progress[-1]) < len(events) - 1
    assert scratch_folders(harness) == []


async def test_each_commit_writes_the_next_task_checkpoint(harness_factory) -> None:  # type: ignore[no-untyped-def]
    """Version 1, then 2: the goal is the session's first request, the progress has one entry
    per settled Turn, and each Turn's `finish` names the version its commit wrote."""
    from fleet_shared.db.models import Session

    harness: Harness = harness_factory(root("SUBMIT(answer='done: ' + request)"))
    first = await harness.submit("summarise the report")
    await harness.work()
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, first)
        assert run is not None
        session_id = run.session_id
    second = await harness.submit("now list its risks", session_id=session_id, key="k2")
    await harness.work()
    versions = []
    for run_id in (first, second):
        terminal = (await harness.events(run_id))[-1]
        assert isinstance(terminal, RunCompleted)
        versions.append(terminal.checkpoint_version)
    assert versions == [1, 2]
    async with harness.db_sessions() as db:
        session = await db.get(Session, session_id)
        assert session is not None and session.checkpoint_version == 2 and session.task is not None
        task = session.task
    assert task["goal"] == "summarise the report"
    assert [(e["run_id"], e["status"], e["request"], e["outcome"]) for e in task["progress"]] == [
        (first, "completed", "summarise the report", "done: summarise the report"),
        (second, "completed", "now list its risks", "done: now list its risks"),
    ]


async def test_a_selected_skill_is_announced_written_to_skills_and_given_to_the_rlm(harness_factory) -> None:  # type: ignore[no-untyped-def]
    from fleet_shared.db import skills as skill_queries
    from fleet_shared.events import IterationStarted, SkillUsed

    harness: Harness = harness_factory(
        root(
            "card = open('skills/csv-analysis.md').read()\n"
            "SUBMIT(answer=f'{len(skills)} {card.splitlines()[0]} | {skills[0].splitlines()[0][:60]}')"
        ),
    )
    async with harness.db_sessions() as db:
        (card,) = await skill_queries.get_skills(db, ["csv-analysis"])
    run_id = await harness.submit(skills=[card])
    await harness.work()
    events = await harness.events(run_id)
    assert isinstance(events[-1], RunCompleted), events[-1]
    used = of(events, SkillUsed)
    assert [(u.skill_id, u.version, u.phase) for u in used] == [
        ("csv-analysis", card.version, "activated"),
        ("csv-analysis", card.version, "loaded"),
    ]
    assert events.index(used[-1]) < events.index(of(events, IterationStarted)[0])
    (answer,) = of(events, Answer)
    head = f"1 # {card.name} (version {card.version}) | "
    given = f"{card.name} (version {card.version}, /workspace/skills/csv-analysis.md): {card.description}"
    assert answer.text == head + given[:60]
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
        assert run is not None
        turns = await queries.list_turns(db, run.session_id, after_sequence=0, limit=10)
    phases = [p["data"]["phase"] for p in turns[1].parts if p["type"] == "data-skill"]
    assert phases == ["activated", "loaded"]


async def test_the_task_route_serves_the_checkpoint(harness_factory) -> None:  # type: ignore[no-untyped-def]
    from litestar.testing import AsyncTestClient

    from fleet_gateway.app import create_app

    harness: Harness = harness_factory(root("SUBMIT(answer='noted')"))
    async with AsyncTestClient(create_app(harness.settings)) as client:
        session_id = (await client.post("/api/sessions", json={})).json()["id"]
        fresh = await client.get(f"/api/sessions/{session_id}/task")
        assert fresh.status_code == 200 and fresh.json() == {
            "session_id": session_id,
            "checkpoint_version": 0,
        }
        run_id = await harness.submit("plan the trip", session_id=session_id)
        await harness.work()
        task = (await client.get(f"/api/sessions/{session_id}/task")).json()
        assert task["checkpoint_version"] == 1 and task["goal"] == "plan the trip"
        assert [(p["run_id"], p["outcome"]) for p in task["progress"]] == [(run_id, "noted")]
        missing = await client.get("/api/sessions/00000000-0000-0000-0000-000000000000/task")
        assert missing.status_code == 404 and missing.json()["code"] == "not_found"


async def test_a_child_slower_than_the_cell_timeout_does_not_time_its_parents_cell_out(
    harness_factory,
) -> None:  # type: ignore[no-untyped-def]
    """The harness's cells time out after 2 s; the child's two actions take 1.5 s each (scripted
    delay). Host tool time is not the cell's own, so the parent keeps its REPL and its state."""
    harness: Harness = harness_factory(
        root("kept = 'parent state'\nc = rlm_query('slow work')\nprint(c)"),
        root("SUBMIT(answer=kept + ' + ' + c)"),
        child("x = 'child'", delay_s=1.5),
        child("SUBMIT(answer=x + ' done')", delay_s=1.5),
        rlm=RECURSIVE,
    )
    run_id = await harness.submit()
    await harness.work()
    events = await harness.events(run_id)
    assert isinstance(events[-1], RunCompleted), events[-1]
    assert [a.text for a in of(events, Answer)] == ["parent state + child done"]


async def test_a_provider_error_in_llm_query_reaches_the_cell_without_the_providers_text(
    harness_factory,
) -> None:  # type: ignore[no-untyped-def]
    """The sub-LM points at a closed loopback port: the cell and the stream see DSPy's code only."""
    import msgspec

    from fleet_shared.config import Secret

    harness: Harness = harness_factory(
        root(
            "try:\n    llm_query('hi')\nexcept RuntimeError as exc:\n    why = str(exc)\nSUBMIT(answer=why)"
        ),
    )
    sub_lm = msgspec.structs.replace(
        harness.settings.root_lm,
        name="openai/nowhere",
        scripted=False,
        script_path=None,
        base_url="http://user:sub-secret@127.0.0.1:9/v1",
        api_key=Secret("sk-sub-key"),
        num_retries=0,
        request_timeout=5,
    )
    harness.settings = msgspec.structs.replace(harness.settings, sub_lm=sub_lm)
    run_id = await harness.submit()
    await harness.work()
    events = await harness.events(run_id)
    (answer,) = of(events, Answer)
    assert answer.text.startswith("RuntimeError: the LM call failed (") and "openai/nowhere" in answer.text
    assert not any(
        secret in repr(e) for e in events for secret in ("sub-secret", "127.0.0.1:9", "sk-sub-key")
    )


class SlowScratch:
    """The real local provider, with a slow `acquire_scratch` and a slow release (a Daytona
    create or delete takes seconds): the Turn's settlement races the child's own thread."""

    def __init__(self, real: Any, acquire_s: float = 0.0, release_s: float = 0.0) -> None:
        self.real, self.acquire_s, self.release_s = real, acquire_s, release_s

    def acquire_scratch(self, run_id: str) -> Any:
        import time

        time.sleep(self.acquire_s)
        lease = self.real.acquire_scratch(run_id)
        release, delay = lease.release, self.release_s

        def slow_release() -> None:
            time.sleep(delay)
            release()

        lease.release = slow_release
        return lease


def wait_until(condition: Any, seconds: float = 10) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def child_runner(harness: Harness, provider: Any) -> tuple[Any, Any, list[RunEvent]]:
    import threading

    from fleet_worker.budget import CallBudget
    from fleet_worker.children import ChildPolicy, ChildRunner
    from fleet_worker.observer import TurnObserver

    emitted: list[RunEvent] = []
    parent = TurnObserver(
        emit=emitted.append, run_id="run-race", stop=threading.Event(), max_output_chars=1000
    )
    policy = ChildPolicy(
        max_children=2, max_iters=2, max_llm_calls=4, max_output_chars=1000, batch_concurrency=1
    )

    def no_lms() -> tuple[Any, Any]:
        raise AssertionError("the child should have been stopped before its LMs were built")

    return ChildRunner(provider, CallBudget(10), parent, policy, no_lms), parent, emitted


def test_a_child_sandbox_made_after_the_turn_settled_is_still_released(harness_factory) -> None:  # type: ignore[no-untyped-def]
    import threading

    from fleet_worker.app import sandbox_provider
    from fleet_worker.errors import TurnStopped

    harness: Harness = harness_factory(root("pass"))
    real = sandbox_provider(harness.settings)
    real.place_workspaces(harness.settings.data_dir / "workspaces", harness.settings.data_dir / "relocated")
    runner, parent, emitted = child_runner(harness, SlowScratch(real, acquire_s=0.6))
    raised: list[BaseException] = []

    def parents_cell() -> None:
        try:
            runner.run("a task")
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=parents_cell, daemon=True)
    thread.start()
    wait_until(lambda: bool(emitted))  # started
    parent.stop.set()  # the Turn is cancelled while the child's sandbox is being made
    finals = runner.settle(wait_seconds=10)
    thread.join(10)
    real.close()
    assert isinstance(raised[0], TurnStopped), raised
    assert [(f.state, f.cleanup_state) for f in finals] == [("cancelled", "released")]
    assert scratch_folders(harness) == []


def test_settlement_waits_for_a_slow_release_and_returns_its_report(harness_factory) -> None:  # type: ignore[no-untyped-def]
    """The child's thread is releasing (slowly) when the Turn settles: the report is not lost."""
    import threading

    from fleet_worker.app import sandbox_provider

    harness: Harness = harness_factory(root("pass"))
    real = sandbox_provider(harness.settings)
    real.place_workspaces(harness.settings.data_dir / "workspaces", harness.settings.data_dir / "relocated")
    runner, parent, emitted = child_runner(harness, SlowScratch(real, acquire_s=0.3, release_s=1.0))
    raised: list[BaseException] = []

    def parents_cell() -> None:
        try:
            runner.run("a task")
        except BaseException as exc:  # TurnStopped, as the parent's cell would see it
            raised.append(exc)

    thread = threading.Thread(target=parents_cell, daemon=True)
    thread.start()
    wait_until(lambda: bool(emitted))  # started: its sandbox is being made
    parent.stop.set()  # so the child stops as soon as it has it, and releases it (slowly)
    wait_until(lambda: runner.children[0].closing)
    finals = runner.settle(wait_seconds=10)  # its own thread is in the slow release now
    thread.join(10)
    real.close()
    assert [(f.state, f.cleanup_state) for f in finals] == [("cancelled", "released")]
    assert scratch_folders(harness) == []


async def test_a_skill_card_changed_after_the_check_fails_the_turn_clearly(harness_factory) -> None:  # type: ignore[no-untyped-def]
    """The user chose version N; the card was re-seeded as N+1 before the Run started: the RLM
    is not given guidance the user did not choose. The Turn fails `skill_unavailable`."""
    from sqlalchemy import update

    from fleet_shared.db import skills as skill_queries
    from fleet_shared.db.models import Skill
    from fleet_shared.events import RunFailed

    harness: Harness = harness_factory(root("SUBMIT(answer='unused')"))
    skill_id = f"changing-{uuid.uuid4().hex[:8]}"  # its own card: the test DB is shared
    async with harness.db_sessions() as db:
        db.add(Skill(id=skill_id, name="Changing", version="1", description="d", body="b", digest="0" * 64))
        await db.commit()
        (card,) = await skill_queries.get_skills(db, [skill_id])
    run_id = await harness.submit(skills=[card])
    async with harness.db_sessions() as db:
        await db.execute(update(Skill).where(Skill.id == skill_id).values(version="2"))
        await db.commit()
    released = REGISTRY.get_sample_value("fleet_sandbox_lease_seconds_count", {"provider": "local"}) or 0
    await harness.work()
    terminal = (await harness.events(run_id))[-1]
    assert isinstance(terminal, RunFailed) and terminal.code == "skill_unavailable"
    assert f"{skill_id!r} changed since the Turn was sent" in terminal.message
    # The sandbox is acquired while the history loads; the load failed, and the lease was released.
    after = REGISTRY.get_sample_value("fleet_sandbox_lease_seconds_count", {"provider": "local"})
    assert after == released + 1
