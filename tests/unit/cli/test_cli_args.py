"""`fleet` argument handling that must never start a server."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet_cli.main import build_parser, main
from fleet_shared.auth_settings import is_loopback

SHIPPED_CONFIG = Path(__file__).resolve().parents[3] / "config" / "fleet.toml"


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("[::]", False),
        ("192.168.1.10", False),
        ("10.0.0.1", False),
        ("example.com", False),
        ("localhost.example.com", False),
        ("", False),
        ("not an address", False),
    ],
)
def test_is_loopback(host: str, expected: bool) -> None:
    assert is_loopback(host) is expected


def exit_code(argv: list[str]) -> int | str | None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "::", "example.com"])
def test_gateway_refuses_non_loopback_bind(
    host: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Were the refusal skipped, loading this missing config would fail: still no server either way.
    monkeypatch.setenv("FLEET_CONFIG", str(tmp_path / "absent.toml"))
    assert exit_code(["gateway", "--host", host]) == 2
    err = capsys.readouterr().err
    assert f"refusing to bind {host}" in err
    assert "--allow-non-loopback-bind" in err
    assert "config error" not in err


def test_allow_flag_passes_the_refusal_and_reaches_config_loading(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = tmp_path / "absent.toml"
    monkeypatch.setenv("FLEET_CONFIG", str(missing))
    assert exit_code(["gateway", "--host", "0.0.0.0", "--allow-non-loopback-bind"]) == 2
    err = capsys.readouterr().err
    assert "refusing" not in err
    assert err.startswith("fleet: config error: ")
    assert str(missing) in err
    assert err.count("\n") == 1


def test_worker_rejects_zero_concurrency(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_CONFIG", str(SHIPPED_CONFIG))
    monkeypatch.setenv("FLEET_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.delenv("FLEET_PROFILE", raising=False)
    monkeypatch.delenv("FLEET_SCRIPTED_LM", raising=False)
    assert exit_code(["worker", "--concurrency", "0"]) == 2
    assert "--concurrency must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [["serve"], ["gateway", "--port", "eighty"], ["db"], ["up", "--workers", "many"]],
    ids=["unknown-command", "bad-port", "db-without-subcommand", "bad-workers"],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_code(argv) == 2
    assert "usage: fleet" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["gateway"],
            {
                "host": "127.0.0.1",
                "port": 8000,
                "workers": 1,
                "allow_non_loopback_bind": False,
                "allow_unauthenticated": False,
            },
        ),
        (["up"], {"host": "127.0.0.1", "port": 8000, "workers": 1, "profile": None}),
        (["worker"], {"concurrency": None, "burst": False, "metrics_host": None, "metrics_port": None}),
        (["db", "check"], {"db_command": "check"}),
    ],
)
def test_defaults_bind_loopback(argv: list[str], expected: dict[str, object]) -> None:
    args = vars(build_parser().parse_args(argv))
    assert {key: args[key] for key in expected} == expected


def shipped_config_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_CONFIG", str(SHIPPED_CONFIG))
    monkeypatch.setenv("FLEET_REDIS_URL", "redis://127.0.0.1:1/0")
    for name in ("FLEET_PROFILE", "FLEET_SCRIPTED_LM", "FLEET_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def test_gateway_off_loopback_refuses_to_serve_without_a_token(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped_config_env(monkeypatch)
    assert exit_code(["gateway", "--host", "0.0.0.0", "--allow-non-loopback-bind"]) == 2
    err = capsys.readouterr().err
    assert "without an API token" in err
    assert "FLEET_API_TOKEN" in err
    assert "--allow-unauthenticated" in err


@pytest.mark.parametrize(
    ("token", "extra"),
    [("a-token", []), (None, ["--allow-unauthenticated"])],
    ids=["token-set", "proxy-authenticates"],
)
def test_gateway_off_loopback_with_a_token_or_the_flag_gets_past_the_refusal(
    token: str | None,
    extra: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    shipped_config_env(monkeypatch)
    if token is not None:
        monkeypatch.setenv("FLEET_API_TOKEN", token)
    # A port held here stops the command at its port check, after the refusals: no server starts.
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        argv = ["gateway", "--host", "0.0.0.0", "--port", str(port), "--allow-non-loopback-bind", *extra]
        assert exit_code(argv) == 2
    err = capsys.readouterr().err
    assert "refusing" not in err
    assert f"0.0.0.0:{port} is already in use" in err
    if token is not None:
        assert token not in err


@pytest.mark.parametrize("host", ["", " ", "\t", "0.0.0.0 ", "127.0.0.1\n"])
def test_worker_refuses_a_blank_metrics_host(
    host: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped_config_env(monkeypatch)
    assert exit_code(["worker", "--metrics-host", host]) == 2  # before it binds every interface
    err = capsys.readouterr().err.strip()
    assert "--metrics-host" in err and "\n" not in err.strip("'\\n")


def test_gc_rejects_a_negative_grace(capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_code(["gc", "--grace-seconds", "-1"]) == 2
    assert capsys.readouterr().err == "fleet: --grace-seconds must be 0 or more\n"


def test_a_bare_fleet_shows_the_commands_and_succeeds(capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_code([]) == 0
    shown = capsys.readouterr().out
    assert "usage: fleet" in shown
    for command in ("up", "cli", "gateway", "worker", "doctor", "gc", "db"):
        assert f"    {command}" in shown


def test_fleet_version_names_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    assert exit_code(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"fleet {version('fleet-cli')}"


@pytest.mark.parametrize("command", ["up", "cli", "gateway"])
def test_host_and_port_say_what_they_are_and_their_defaults(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert exit_code([command, "--help"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "--host HOST address to listen on (default: 127.0.0.1)" in shown
    assert "--port PORT port to listen on (default: 8000)" in shown


@pytest.mark.parametrize("command", ["up", "cli", "gateway", "worker", "daytona", "doctor", "gc", "db"])
def test_each_command_s_help_says_what_it_does(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_code([command, "--help"]) == 0
    description = capsys.readouterr().out.split("\n\n")[1]
    assert not description.startswith(("options:", "positional arguments:")), description
