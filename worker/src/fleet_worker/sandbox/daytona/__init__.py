"""The `daytona` sandbox provider: one Daytona sandbox per session (docs/daytona.md)."""

from fleet_worker.sandbox.daytona.provider import DaytonaSandboxProvider, daytona_provider

__all__ = ["DaytonaSandboxProvider", "daytona_provider"]
