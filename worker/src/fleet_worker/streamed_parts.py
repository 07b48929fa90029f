"""The streamed parts of a Turn: the deltas of each step's reasoning and code, and of an answer
the LM writes itself, batched into events; and how a part's whole text closes what they showed.
Used on the stream's reader and the program's thread; no dspy import."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# A delta event carries what arrived since the last one: at most DELTA_CHUNKS stream chunks, and
# (while chunks keep coming) at most DELTA_SECONDS of them. A part's first chunk goes at once: the
# first visible token waits for nothing.
DELTA_SECONDS = 0.05
DELTA_CHUNKS = 64
ANSWER_PART = "text-answer"  # the Turn's one answer part, streamed or not
REASONING_PREFIX = "reasoning-"  # + the step: its reasoning part
CELL_PREFIX = "cell-"  # + the step: its cell's call id
FENCE = "```"


@dataclass
class StreamedCode:
    """One cell's code field as it streams, shown without the markdown fence the RLM is asked to
    write: the opening line, the closing fence and what follows it, and backticks at the end that
    may yet become that fence are held back. Each chunk is looked at once (a long cell costs in
    proportion to its length)."""

    call_id: str
    head: str = ""  # before the code starts: leading space and the fence's line
    started: bool = False
    held: str = ""  # backticks at the end so far
    closed: bool = False

    def feed(self, text: str) -> str:
        """What this chunk adds to the code shown."""
        if self.closed:
            return ""
        if not self.started:
            self.head += text
            lead = self.head.lstrip()
            if lead.startswith("`"):
                newline = lead.find("\n")
                if newline < 0:  # the fence's line is not complete yet
                    return ""
                lead = lead[newline + 1 :]
            elif not lead:
                return ""
            self.started, self.head, text = True, "", lead
        text = self.held + text
        end = text.find(FENCE)
        if end >= 0:
            self.closed, self.held = True, ""
            return text[:end]
        shown = text.rstrip("`")
        self.held = text[len(shown) :]
        return shown


def closing(text: str, sent: str | None) -> dict[str, Any]:
    """How a part's whole text closes what its deltas `sent` (WholeText's fields): the rest as
    its tail, or, when the stream showed other text (a retried call, a cut), restated."""
    if sent is None:
        return {}
    if text.startswith(head := sent.lstrip()):  # parsed from the field's first non-space
        return {"streamed": True, "tail": text[len(head) :]}
    return {"streamed": True, "restated": True}


@dataclass
class StreamedParts:
    """The deltas of a Turn's streamed parts (each step's reasoning and code, an extracted answer), batched
    (DELTA_SECONDS, DELTA_CHUNKS). The stream's reader adds chunks to the open part; a part's
    begin and end come through the same stream, in order with its chunks, so a chunk is never
    taken for another part's, and none is sent after its part's end (what the stream still held
    then arrives with the whole text)."""

    # Delta events a Turn may send (they count against rlm.max_events like every event); past
    # them a part's text comes whole with its end.
    budget: int = 1_000
    # The characters a part's deltas may carry (the answer: rlm.max_answer_chars, so what was
    # shown is always the start of the answer kept).
    max_chars: dict[str, int] = field(default_factory=dict)
    part_id: str | None = None  # the part whose chunks are arriving
    pending_for: str | None = None  # the part `pending` belongs to: part_id, or its step's code
    pending: list[str] = field(default_factory=list)
    sent: dict[str, str] = field(default_factory=dict)  # each part's text sent so far
    ended: set[str] = field(default_factory=set)
    flushed_at: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def begin(self, part_id: str, send: Callable[[str, str], None]) -> None:
        with self.lock:
            self.flush(send)
            if part_id in self.ended:  # a reader so late that the step has ended: its text came whole
                self.part_id = None
                return
            self.part_id = self.pending_for = part_id
            self.flushed_at = 0.0  # its first chunk goes at once

    def add(self, text: str, send: Callable[[str, str], None], into: str | None = None) -> None:
        """A chunk of the open part, or (`into`) of another part of the same step: its code."""
        with self.lock:
            if self.part_id is None:
                return
            target = into or self.part_id
            if target != self.pending_for:  # the step's next field: what was held goes first
                self.flush(send)
                self.pending_for, self.flushed_at = target, 0.0
            self.pending.append(text)
            now = time.monotonic()
            if len(self.pending) >= DELTA_CHUNKS or now - self.flushed_at >= DELTA_SECONDS:
                self.flush(send, now)

    def end(self, part_id: str, send: Callable[[str, str], None]) -> str | None:
        """The part's end: what was held back is sent; the text its deltas carried, or None."""
        with self.lock:
            if part_id == self.part_id:
                self.flush(send)
                self.part_id = None
            self.ended.add(part_id)
            return self.sent.get(part_id)

    def flush(self, send: Callable[[str, str], None], now: float | None = None) -> None:
        part = self.pending_for if self.part_id is not None else None
        if self.pending and part is not None and self.budget > 0:
            sent = self.sent.get(part, "")
            delta = "".join(self.pending)
            if part in self.max_chars:
                delta = delta[: self.max_chars[part] - len(sent)]
            if delta:
                self.budget -= 1
                self.sent[part] = sent + delta
                send(part, delta)
        self.pending.clear()
        self.flushed_at = time.monotonic() if now is None else now
