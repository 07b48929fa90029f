"""Running one Turn's RLM program on the worker's dedicated thread pool, and stopping it.

The Turn's deadline starts when the program starts on its thread, not when the job was picked
up: a Turn that waited for a free thread has lost none of its time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet_shared.config import ResolvedLM, Settings
from fleet_worker import dspy_adapter
from fleet_worker.approvals import ApprovalGate
from fleet_worker.budget import CallBudget
from fleet_worker.children import ChildPolicy, ChildRunner
from fleet_worker.errors import LeaseLost, QuotaExhausted, TurnCancelled, TurnStopped, TurnTimedOut
from fleet_worker.lease import RunLease
from fleet_worker.lm.script import Script, ScriptCursor, load_script
from fleet_worker.observer import TurnObserver
from fleet_worker.outcome import Outcome
from fleet_worker.publisher import EventSink
from fleet_worker.sandbox.provider import SandboxLease, SandboxProvider
from fleet_worker.streamed_parts import ANSWER_PART, StreamedParts
from fleet_worker.tenant_tokens import TenantTokens
from fleet_worker.turn_trace import TurnTrace

CANCEL_GRACE_SECONDS = 1.0  # a cancelled program gets this long to stop before the Turn settles
STOP_GRACE_SECONDS = 5.0


@dataclass
class ProgramRun:
    """One program on its thread; `started_at` is set (loop time) when the thread picks it up."""

    future: asyncio.Future[dspy_adapter.ProgramResult]
    started: asyncio.Event
    stop: threading.Event
    observer: TurnObserver
    sandbox: SandboxLease
    children: ChildRunner | None = None
    started_at: float = field(default=0.0)


def start_program(
    pool: Executor,
    *,
    settings: Settings,
    scripts: dict[Path, Script],
    request: str,
    history: list[dict[str, str]],
    attachments: list[str],
    skills: list[str],
    sandbox: SandboxLease,
    provider: SandboxProvider,
    sink: EventSink,
    tokens: TenantTokens | None = None,
    trace: TurnTrace | None = None,
    approvals: ApprovalGate | None = None,
    instructions: str | None = None,
) -> ProgramRun:
    loop = asyncio.get_running_loop()
    stop = threading.Event()
    if approvals is not None:
        approvals.stop = stop  # a cancel or the deadline ends a wait for approval at once
    started = asyncio.Event()
    rlm = settings.profile.rlm
    observer = TurnObserver(
        emit=sink.emit_threadsafe if trace is None else trace.watching(sink.emit_threadsafe),
        run_id=sink.sequencer.run_id,
        stop=stop,
        max_output_chars=rlm.max_output_chars,
        budget=CallBudget(rlm.max_llm_calls),
        batch_concurrency=rlm.batch_concurrency,
        describe_failure=dspy_adapter.describe_batch_failure,
        tokens=tokens,
        # Most of the event cap stays for the steps; the answer streams no more than is kept.
        streaming=StreamedParts(budget=rlm.max_events // 5, max_chars={ANSWER_PART: rlm.max_answer_chars}),
        approvals=approvals,
    )
    root_cursor, sub_cursor = cursors(scripts, settings, request)
    children = None
    if rlm.recursion:
        policy = ChildPolicy(
            max_children=rlm.max_children,
            max_iters=rlm.child_max_iters,
            max_llm_calls=rlm.child_max_llm_calls,
            max_output_chars=rlm.max_output_chars,
            batch_concurrency=rlm.batch_concurrency,
        )

        def child_lms() -> tuple[Any, Any]:
            return (
                dspy_adapter.build_lm(settings.root_lm, "child", root_cursor, stop, trace),
                dspy_adapter.build_lm(settings.sub_lm, "sub", sub_cursor, stop, trace),
            )

        children = ChildRunner(provider, observer.budget, observer, policy, child_lms)
    call = functools.partial(
        dspy_adapter.run_program,
        request=request,
        history=history,
        attachments=attachments,
        skills=skills,
        root_lm=dspy_adapter.build_lm(settings.root_lm, "root", root_cursor, stop, trace),
        sub_lm=dspy_adapter.build_lm(settings.sub_lm, "sub", sub_cursor, stop, trace),
        limits=dspy_adapter.ProgramLimits(rlm.max_iters, rlm.max_llm_calls, rlm.max_output_chars),
        observer=observer,
        interpreter_factory=sandbox.interpreter_factory,
        tools=[children.tool()] if children is not None else None,
        # The scripted LM answers at once: a stream would show nothing, and it costs time
        # (bench/evidence/reasoning-stream/).
        stream=not settings.root_lm.scripted,
        instructions=instructions,
    )
    run = ProgramRun(asyncio.Future(), started, stop, observer, sandbox, children)

    def on_thread() -> dspy_adapter.ProgramResult:
        loop.call_soon_threadsafe(mark_started, run, loop)
        try:
            return call()
        except TurnStopped:
            if tokens is not None and tokens.warned:  # the tenant's tokens ran out (check_quota)
                raise QuotaExhausted(tokens.spent) from None
            raise

    run.future = asyncio.wrap_future(pool.submit(on_thread), loop=loop)
    # However it ends, even after we stop waiting, its exception is expected: mark it retrieved.
    run.future.add_done_callback(lambda done: done.cancelled() or done.exception())
    return run


def mark_started(run: ProgramRun, loop: asyncio.AbstractEventLoop) -> None:
    run.started_at = loop.time()
    run.started.set()


async def wait_for_program(
    run: ProgramRun, lease: RunLease, turn_seconds: float, sink: EventSink, sandbox_ops: Executor
) -> dspy_adapter.ProgramResult:
    """The program's result, or TurnCancelled / LeaseLost / TurnTimedOut once it was stopped."""
    cancel: asyncio.Future[object] = asyncio.ensure_future(lease.cancel_requested.wait())
    lost: asyncio.Future[object] = asyncio.ensure_future(lease.lost.wait())
    try:
        started: asyncio.Future[object] = asyncio.ensure_future(run.started.wait())
        # Waiting for a free thread (one still held by a program that ignores its stop) is bounded
        # by the Turn's timeout too, though the clock proper starts when the program does.
        await asyncio.wait({started, cancel, lost}, timeout=turn_seconds, return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        if run.started.is_set():
            remaining = run.started_at + turn_seconds - asyncio.get_running_loop().time()
            ending: set[asyncio.Future[object]] = {run.future, cancel, lost}  # type: ignore[arg-type]
            await asyncio.wait(ending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await asyncio.shield(stop_program(run, sink, sandbox_ops, STOP_GRACE_SECONDS))
        raise
    finally:
        cancel.cancel()
        lost.cancel()
    if run.future.done():  # it ended on its own: a cancel or a loss that came later is moot
        return run.future.result()
    if lease.cancel_requested.is_set():
        await stop_program(run, sink, sandbox_ops, CANCEL_GRACE_SECONDS)
        raise TurnCancelled("the Turn was cancelled")
    await stop_program(run, sink, sandbox_ops, STOP_GRACE_SECONDS)
    if lease.lost.is_set():
        raise LeaseLost("this worker lost the Turn's lease; another process settled it")
    if not run.started.is_set():
        raise TurnTimedOut(f"no program thread came free within {turn_seconds:g} s")
    tokens = run.observer.tokens
    if tokens is not None and tokens.warned:  # it was stopping for the quota, then ran out of time
        raise QuotaExhausted(tokens.spent)
    raise TurnTimedOut(f"the Turn exceeded runtime.turn_timeout_seconds ({turn_seconds:g} s)")


async def stop_program(run: ProgramRun, sink: EventSink, sandbox_ops: Executor, grace: float) -> None:
    """Stop at the next boundary, kill the running cell, then wait a little for the thread."""
    run.stop.set()
    if not run.started.is_set():
        run.future.cancel()  # still waiting for a thread: it never starts
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(sandbox_ops, run.sandbox.interrupt)
    if run.children is not None:
        await loop.run_in_executor(sandbox_ops, run.children.interrupt)
    await asyncio.wait({run.future}, timeout=grace)
    sink.accepting_thread_events = False


Cursors = tuple[ScriptCursor | None, ScriptCursor | None]


def cursors(scripts: dict[Path, Script], settings: Settings, request: str) -> Cursors:
    """One Run's cursors for the scripted LMs: root and sub share one when they read the same
    file (each role keeps its own place), and each has its own when their scripts differ. The
    request picks each script's scenario."""
    root = settings.root_lm
    sub = settings.sub_lm
    root_cursor = script_for(scripts, root).cursor(request) if root.scripted else None
    if not sub.scripted:
        return root_cursor, None
    if root_cursor is not None and sub.script_path == root.script_path:
        return root_cursor, root_cursor
    return root_cursor, script_for(scripts, sub).cursor(request)


def script_for(scripts: dict[Path, Script], lm: ResolvedLM) -> Script:
    assert lm.script_path is not None
    script = scripts.get(lm.script_path)
    if script is None:
        script = load_script(lm.script_path, lm.name.removeprefix("scripted/"))
        scripts[lm.script_path] = script
    return script


def with_observations(outcome: Outcome, run: ProgramRun | None) -> Outcome:
    """An ending that did not come from the program's result still reports what it used."""
    if run is None:
        return outcome
    observer = run.observer
    return dataclasses.replace(outcome, iterations=observer.iteration, lm_usage=observer.usage_snapshot())
