"""Daytona SDK errors as Run failures: a stable code and a message safe to show (no URL, no key)."""

from __future__ import annotations

from daytona import (
    DaytonaAuthenticationError,
    DaytonaAuthorizationError,
    DaytonaError,
    DaytonaNotFoundError,
    DaytonaRateLimitError,
    DaytonaTimeoutError,
)

from fleet_worker.errors import SandboxFailed

QUOTA_WORDS = ("quota", "limit", "exceed", "insufficient")


def run_failure(exc: BaseException, *, snapshot: str, doing: str) -> SandboxFailed:
    """What a failed Daytona call while `doing` means for the Run."""
    status = getattr(exc, "status_code", None)
    detail = f" (HTTP {status})" if status else ""
    text = str(exc).lower()
    if isinstance(exc, DaytonaAuthenticationError):
        return SandboxFailed(f"Daytona refused the API key while {doing}{detail}", code="sandbox_auth")
    if isinstance(exc, DaytonaRateLimitError) or (
        isinstance(exc, DaytonaAuthorizationError) and any(w in text for w in QUOTA_WORDS)
    ):
        return SandboxFailed(
            f"Daytona's quota or rate limit was reached while {doing}{detail}; retry later",
            code="sandbox_quota",
        )
    if isinstance(exc, DaytonaAuthorizationError):
        return SandboxFailed(f"Daytona denied {doing}{detail}", code="sandbox_auth")
    if isinstance(exc, DaytonaNotFoundError) and "snapshot" in text:
        return SandboxFailed(
            f"the Daytona snapshot {snapshot!r} does not exist: run `fleet daytona snapshot`",
            code="sandbox_snapshot_missing",
        )
    if isinstance(exc, DaytonaTimeoutError):
        return SandboxFailed(f"Daytona timed out while {doing}", code="sandbox_timeout")
    if isinstance(exc, DaytonaError):
        return SandboxFailed(f"Daytona failed while {doing}{detail}", code="sandbox_unavailable")
    return SandboxFailed(f"Daytona could not be reached while {doing}", code="sandbox_unavailable")
