"""The result of one `fleet doctor` check: shared by the CLI's checks and the worker's sandbox checks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import msgspec

# ok and warn and skip pass; only a fail makes `fleet doctor` exit 1.
CheckStatus = Literal["ok", "warn", "skip", "fail"]


class Check(msgspec.Struct, frozen=True, kw_only=True):
    """One line of `fleet doctor`: what was checked, how it went (one line), and for a fail or a
    warn the concrete thing to do about it."""

    name: str
    status: CheckStatus
    detail: str
    fix: str | None = None


def all_passed(checks: Iterable[Check]) -> bool:
    """True when no check failed (warnings and skips are fine)."""
    return all(check.status != "fail" for check in checks)
