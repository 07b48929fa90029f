"""Named errors raised by the local code sandbox."""

from __future__ import annotations

from fleet_shared.errors import FleetError

INSTALL_HINT = (
    "install bubblewrap (`apt-get install bubblewrap`) or set "
    "sandbox.local.allow_unisolated = true to run cells WITHOUT isolation"
)


class SandboxError(FleetError):
    """Base class for every sandbox failure."""


class SandboxUnavailable(SandboxError):
    """No usable isolation: bwrap is missing or broken and unisolated runs are not allowed."""

    def __init__(self, reason: str, fix: str = INSTALL_HINT) -> None:
        super().__init__(f"{reason}; {fix}")
        self.reason = reason  # apart, for `fleet doctor`'s detail and fix lines
        self.fix = fix


class CellFailed(SandboxError):
    """A cell ended without a result of its own; carries what it printed before that."""

    def __init__(self, message: str, *, stdout: str = "", truncated: bool = False) -> None:
        super().__init__(message)
        self.stdout = stdout
        self.truncated = truncated


class CellTimeout(CellFailed):
    """A cell ran past the per-cell timeout; its REPL was killed and replaced by a fresh one."""

    def __init__(self, timeout_seconds: float, *, stdout: str = "", truncated: bool = False) -> None:
        super().__init__(
            f"the cell exceeded the {timeout_seconds:g}s timeout; the REPL was killed and "
            "restarted, so every variable and import from earlier cells is lost",
            stdout=stdout,
            truncated=truncated,
        )


class CellInterrupted(CellFailed):
    """The running cell was cancelled from the host; its REPL was killed and state is lost."""


class CellCrashed(CellFailed):
    """The REPL died (or was stopped) during a cell; it was replaced by a fresh one."""


class SandboxCrashed(SandboxError):
    """The REPL process died or broke the frame protocol; the session cannot be used again."""


class SandboxStopped(SandboxCrashed):
    """The host stopped a REPL on purpose mid-cell (it was frozen, or it overran a budget)."""


class OverBudget(SandboxStopped):
    """A running cell grew its workspace past the budget (what it wrote past it is removed)."""


class FrameTimeout(SandboxError):
    """A frame could not be read or written before its deadline."""


class FrameTooLarge(SandboxError):
    """A message to the REPL encodes to more than the maximum frame size."""
