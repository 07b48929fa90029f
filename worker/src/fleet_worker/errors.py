"""Named failures of a Turn. Each carries the failure code recorded on the Run and in the stream."""

from __future__ import annotations


class TurnFailed(Exception):
    """A Turn ended in failure; `code` is stable and documented, `message` is for people."""

    code = "internal_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class ScriptExhausted(TurnFailed):
    code = "script_exhausted"


class ScriptInvalid(TurnFailed):
    code = "script_invalid"


class SandboxFailed(TurnFailed):
    code = "sandbox_error"


class TurnTimedOut(TurnFailed):
    code = "turn_timeout"


class QuotaExhausted(TurnFailed):
    """The tenant's LM tokens for the day (`quotas.lm_tokens_per_day`) ran out during the Turn."""

    code = "quota_exhausted"


class TurnStopped(BaseException):
    """Raised inside the RLM thread when the Turn was told to stop (timeout; later cancel).

    A BaseException on purpose: DSPy logs and swallows `Exception`s raised by callbacks, and a
    stop must actually stop the next LM call.
    """


class TurnCancelled(TurnFailed):
    """A client cancelled the Turn (PUT /api/runs/{id}/cancellation)."""

    code = "cancelled"


class LeaseLost(TurnFailed):
    """Another process holds the Run's lease: this worker was swept and must stop."""

    code = "lease_lost"
