"""One Turn's `rlm.max_llm_calls`: a single budget for the root, the sub-LM and child RLMs.

Every LM call of a Turn counts against it. The root's own actions are always admitted
(`rlm.max_iters` bounds them) but they count, so the sub-LM and the children get what is left.
Sub-LM prompts are admitted before they are sent, all of a batch or none of it; a child takes a
slice up front, spends its root actions and sub-LM prompts from that slice, and gives back what
it did not use. Admission is atomic under one lock, because batched prompts and a child's calls
come from several threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


class LLMBudgetExhausted(RuntimeError):
    """A call the budget cannot admit. Inside the sandbox the cell sees it as a RuntimeError it
    can catch, and the RLM can carry on with plain Python."""


class ChildBudgetExhausted(BaseException):
    """A child RLM's root action found its slice empty: the child stops (a BaseException, so
    neither DSPy nor its callbacks swallow it) and its `rlm_query` fails recoverably."""


@dataclass
class CallBudget:
    limit: int
    used: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def remaining(self) -> int:
        with self.lock:
            return max(0, self.limit - self.used)

    def charge(self, n: int = 1) -> None:
        """Count calls that are admitted whatever the balance (the root's actions)."""
        with self.lock:
            self.used += n

    def admit(self, n: int) -> bool:
        """Take `n` calls if all of them fit; otherwise take none."""
        with self.lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            return True

    def refusal(self, n: int, what: str) -> LLMBudgetExhausted:
        with self.lock:
            used = self.used
        return LLMBudgetExhausted(
            f"LLM call budget exhausted: {what} needs {n} call(s) but only {max(0, self.limit - used)} "
            f"of this Turn's {self.limit} (rlm.max_llm_calls) are left. Carry on with plain Python, "
            "or SUBMIT what you have."
        )

    def take_slice(self, wanted: int, minimum: int) -> BudgetSlice | None:
        """Up to `wanted` calls for a child (at least `minimum`), or None when fewer are left."""
        with self.lock:
            granted = min(wanted, self.limit - self.used)
            if granted < minimum:
                return None
            self.used += granted
            return BudgetSlice(limit=granted, parent=self)

    def give_back(self, n: int) -> None:
        with self.lock:
            self.used -= n


@dataclass
class BudgetSlice(CallBudget):
    """A child's share: taken from the parent whole, the unused rest returned when it ends."""

    parent: CallBudget | None = None
    returned: bool = False

    def charge(self, n: int = 1) -> None:
        """A child's root action: refused, ending the child, once its slice is spent."""
        if not self.admit(n):
            raise ChildBudgetExhausted(f"the child RLM used all {self.limit} calls of its budget slice")

    def close(self) -> int:
        """Return the unused calls to the parent (once); how many the child used."""
        with self.lock:
            used, unused = min(self.used, self.limit), max(0, self.limit - self.used)
            already, self.returned = self.returned, True
        if not already and self.parent is not None and unused:
            self.parent.give_back(unused)
        return used
