"""`rlm_query(task)`: one level of child RLMs, each in a fresh throwaway sandbox, on a slice of the
Turn's one LM budget, with its life (and its cleanup, always) reported as `data-child-progress`.

A child runs synchronously on the thread of the parent's tool call, so the parent's cell waits
for its answer. The child gets no `rlm_query` of its own: a child cannot recurse.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from fleet_shared.events import ChildProgress, ChildState, CleanupState
from fleet_worker import dspy_adapter
from fleet_worker.budget import BudgetSlice, CallBudget, ChildBudgetExhausted, LLMBudgetExhausted
from fleet_worker.errors import TurnStopped
from fleet_worker.observer import TurnObserver
from fleet_worker.sandbox.errors import SandboxError
from fleet_worker.sandbox.provider import SandboxLease, SandboxProvider
from fleet_worker.sandbox.workspace import HOST_PATHS

log = structlog.get_logger(__name__)
LABEL_CHARS = 80
MIN_CHILD_CALLS = 2  # one action and one more (an answer, or the extract fallback)
SETTLE_WAIT_SECONDS = 30.0  # for a child sandbox still being made when the Turn ends


@dataclass(frozen=True)
class ChildPolicy:
    max_children: int
    max_iters: int
    max_llm_calls: int
    max_output_chars: int
    batch_concurrency: int


@dataclass
class Child:
    """One child's state. Its cleanup is taken on once (`closing`), by its own thread or, if that
    thread is stuck or abandoned, by the Turn's settlement; `done` is set when `final` is known."""

    child_id: str
    task_label: str
    started: float
    acquiring: bool = True  # its sandbox is being made: only its own thread may release it
    lease: SandboxLease | None = None
    closing: bool = False
    final: ChildProgress | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class ChildRunner:
    """The parent's `rlm_query` tool, and what it started (for interrupts and the final report)."""

    provider: SandboxProvider
    budget: CallBudget
    parent: TurnObserver
    policy: ChildPolicy
    make_lms: Callable[[], tuple[Any, Any]]  # a fresh (root, sub) dspy.LM pair per child
    children: list[Child] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def tool(self) -> Callable[[str], str]:
        def rlm_query(task: str) -> str:
            """Start a child RLM on `task`, in a fresh, empty sandbox of its own, and return its
            answer. Put everything it needs in the task text. It takes a slice of the LM budget:
            use it only for a subtask that needs several steps of its own."""
            return self.run(task)

        return rlm_query

    def run(self, task: str) -> str:
        self.parent.check_stop()
        if not isinstance(task, str) or not task.strip():
            raise ValueError("rlm_query needs a non-empty task string")
        child = self.admit(task)
        budget_slice = self.budget.take_slice(self.policy.max_llm_calls, MIN_CHILD_CALLS)
        if budget_slice is None:
            with self.lock:
                self.children.remove(child)
            raise self.parent.refuse(MIN_CHILD_CALLS, "rlm_query")
        self.parent.emit(self.progress(child, "started", "pending"))
        state: ChildState = "failed"
        try:
            answer = self.run_child(child, task, budget_slice)
            state = "completed"
            return answer
        except TurnStopped:
            state = "cancelled"
            raise
        finally:
            budget_slice.close()
            self.finish(child, state)

    def admit(self, task: str) -> Child:
        with self.lock:
            if len(self.children) >= self.policy.max_children:
                raise RuntimeError(
                    f"this Turn already started {self.policy.max_children} child RLMs (rlm.max_children)"
                )
            label = " ".join(task.split())
            if len(label) > LABEL_CHARS:
                label = label[: LABEL_CHARS - 1] + "…"
            child = Child(f"child-{len(self.children) + 1}", label, time.monotonic())
            self.children.append(child)
            return child

    def run_child(self, child: Child, task: str, budget_slice: BudgetSlice) -> str:
        policy = self.policy
        try:
            lease = self.provider.acquire_scratch(self.parent.run_id)
        except (SandboxError, OSError) as exc:
            raise RuntimeError(
                f"the child RLM's sandbox could not start: {HOST_PATHS.scrub(str(exc))}"
            ) from None
        finally:
            with self.lock:
                child.acquiring = False
        with self.lock:
            child.lease = lease  # released by finish(), or by settle() if this thread is stuck
        self.parent.check_stop()  # the Turn may have ended while the sandbox was being made
        observer = TurnObserver(
            emit=self.parent.emit,
            run_id=self.parent.run_id,
            stop=self.parent.stop,
            max_output_chars=policy.max_output_chars,
            budget=budget_slice,
            batch_concurrency=policy.batch_concurrency,
            describe_failure=self.parent.describe_failure,
            quiet=True,  # the parent's stream shows the child's progress, not its steps
            tokens=self.parent.tokens,
            unstreamed=self.parent.unstreamed,
        )
        root_lm, sub_lm = self.make_lms()
        limits = dspy_adapter.ProgramLimits(policy.max_iters, budget_slice.limit, policy.max_output_chars)
        try:
            return dspy_adapter.run_child_program(
                task=task,
                root_lm=root_lm,
                sub_lm=sub_lm,
                limits=limits,
                observer=observer,
                interpreter_factory=lease.interpreter_factory,
            )
        except ChildBudgetExhausted as exc:
            raise LLMBudgetExhausted(f"{exc}; its work so far is lost, give it a smaller task") from None
        except TurnStopped:
            raise
        except Exception as exc:
            if self.parent.stop.is_set():
                raise TurnStopped("the Turn was stopped") from None
            if dspy_adapter.is_lm_error(exc):
                raise RuntimeError(f"the child RLM failed: {dspy_adapter.lm_error_message(exc)}") from None
            raise RuntimeError(f"the child RLM failed: {HOST_PATHS.scrub(str(exc))}") from None

    def finish(self, child: Child, state: ChildState) -> None:
        """The child's own thread: release its sandbox and report how that went."""
        event = self.close(child, state)
        if event is not None:
            self.parent.emit(event)  # may be dropped if the Turn stopped waiting: settle() resends

    def close(self, child: Child, state: ChildState) -> ChildProgress | None:
        """Take the child's cleanup on (None if someone already has), release, record the end."""
        with self.lock:
            if child.closing:
                return None
            child.closing = True
            lease = child.lease
        cleanup: CleanupState = "released"
        if lease is not None:
            try:
                lease.release()
            except Exception as exc:
                cleanup = "failed"
                log.warning("child.cleanup_failed", child_id=child.child_id, error=str(exc))
        child.final = self.progress(child, state, cleanup)
        child.done.set()
        return child.final

    def progress(self, child: Child, state: ChildState, cleanup: CleanupState) -> ChildProgress:
        return ChildProgress(
            run_id=self.parent.run_id,
            child_id=child.child_id,
            task_label=child.task_label,
            state=state,
            cleanup_state=cleanup,
            elapsed_ms=int((time.monotonic() - child.started) * 1000),
        )

    def interrupt(self) -> None:
        """Kill the running cells of every child (the parent is being stopped)."""
        with self.lock:
            leases = [c.lease for c in self.children if c.lease is not None and not c.closing]
        for lease in leases:
            lease.interrupt()

    def settle(self, wait_seconds: float = SETTLE_WAIT_SECONDS) -> list[ChildProgress]:
        """At the Turn's end (blocking; not on the event loop): every child's final report.
        Children whose thread is stuck are released here; a sandbox still being made is left to
        its own thread (it releases it when the make returns) and waited for a while; past that,
        its report says `cleanup_state: pending`. The caller emits what the stream lacks."""
        with self.lock:
            children = list(self.children)
        for child in children:
            with self.lock:
                mine = not child.acquiring
            if mine:
                self.close(child, "cancelled")
        deadline = time.monotonic() + wait_seconds
        finals = []
        for child in children:
            child.done.wait(max(0.0, deadline - time.monotonic()))
            finals.append(child.final or self.progress(child, "cancelled", "pending"))
        return finals
