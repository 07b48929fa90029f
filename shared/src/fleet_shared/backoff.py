"""The one retry delay policy: capped exponential, from redis-py's own `ExponentialBackoff`."""

from __future__ import annotations

from redis.backoff import ExponentialBackoff


class Backoff:
    """Delays that double from `first` up to `cap` with each failure in a row; `reset()` after a
    success starts again from `first`."""

    def __init__(self, first: float, cap: float) -> None:
        self.policy = ExponentialBackoff(cap=cap, base=first)
        self.failures = 0

    @property
    def pending(self) -> float:
        """The delay the next failure waits."""
        return float(self.policy.compute(self.failures))

    def next(self) -> float:
        """The delay to wait after this failure; the next one waits longer, up to `cap`."""
        delay = self.pending
        self.failures += 1
        return delay

    def reset(self) -> None:
        self.failures = 0
