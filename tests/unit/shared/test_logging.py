"""What reaches the log: a traceback keeps its stack and message, never a frame's locals or a URL's
password; secret-looking keys are blanked at any depth."""

from __future__ import annotations

import json
import subprocess
import sys

PROGRAM = r"""
import logging
import structlog
from fleet_shared.config import ObservabilitySection
from fleet_shared.logging import configure_logging

configure_logging(ObservabilitySection(), process="test")

def handler(authorization, text):
    settings_url = "postgresql+asyncpg://fleet:db-PASSWORD-1@db:5432/fleet"
    raise RuntimeError("cannot reach redis://:redis-PASSWORD-2@cache:6379/0")

try:
    handler("Bearer tok-SECRET-3", "MY-PRIVATE-TEXT-4")
except RuntimeError:
    structlog.get_logger("t").error("request.failed", exc_info=True, nested={"api_key": "k-SECRET-5"})
    logging.getLogger("arq.worker").exception("job failed")
structlog.get_logger("t").warning("lm", error="failed to connect to proxyuser:PROXY-PW-6@127.0.0.1:1")
try:
    raise ConnectionError(
        "no postgresql+asyncpg://fleet@db/fleet?sslmode=require&password=QUERY-PW-7, "
        "no https://lm.internal/v1?api_key=QUERY-KEY-8 (sent Bearer abcBEARER-9)"
    )
except ConnectionError:
    structlog.get_logger("t").error("connect.failed", exc_info=True)
"""
SECRETS = (
    "db-PASSWORD-1",
    "redis-PASSWORD-2",
    "tok-SECRET-3",
    "MY-PRIVATE-TEXT-4",
    "k-SECRET-5",
    "PROXY-PW-6",
    "QUERY-PW-7",
    "QUERY-KEY-8",
    "abcBEARER-9",
)


def test_tracebacks_carry_no_locals_and_no_secrets() -> None:
    result = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True)
    lines = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert len(lines) == 4, result.stderr
    for secret in SECRETS:
        assert secret not in result.stderr, secret
    ours = lines[0]
    frames = ours["exception"][0]["frames"]
    assert ours["exception"][0]["exc_type"] == "RuntimeError"
    assert any(frame["name"] == "handler" for frame in frames)
    assert all("locals" not in frame for frame in frames)
    assert "redis://:***@cache:6379/0" in ours["exception"][0]["exc_value"]
    assert "job failed" in lines[1]["event"] and "RuntimeError" in json.dumps(lines[1])
    assert lines[2]["error"] == "failed to connect to proxyuser:***@127.0.0.1:1"
    assert lines[3]["exception"][0]["exc_value"] == (
        "no postgresql+asyncpg://***@db/fleet?sslmode=require&password=***, "
        "no https://lm.internal/v1?api_key=*** (sent Bearer ***)"
    )


def run_program(log_format: str, *, terminal: bool) -> str:
    """PROGRAM with this log format, its stderr a pipe or a pseudo-terminal."""
    import os
    import pty

    program = PROGRAM.replace("ObservabilitySection()", f"ObservabilitySection(log_format={log_format!r})")
    if not terminal:
        result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
        return result.stderr
    leader, follower = pty.openpty()
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", program], stderr=follower, stdout=subprocess.DEVNULL
        )
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert process.wait(timeout=30) == 0
    finally:
        os.close(leader)
    return b"".join(chunks).decode()


def test_auto_is_json_lines_when_stderr_is_not_a_terminal() -> None:
    err = run_program("auto", terminal=False)
    assert sum(line.startswith("{") for line in err.splitlines()) == 4, err


def test_auto_renders_for_a_person_at_a_terminal_and_still_redacts() -> None:
    err = run_program("auto", terminal=True)
    assert not any(line.startswith("{") for line in err.splitlines()), err
    assert "\x1b[" in err  # colours
    assert "request.failed" in err and "Traceback" in err and "handler" in err
    for secret in SECRETS:
        assert secret not in err, secret


def test_console_forced_into_a_pipe_is_plain_text_with_its_traceback() -> None:
    err = run_program("console", terminal=False)
    assert "\x1b[" not in err
    assert "Traceback" in err and "RuntimeError" in err
    assert "sslmode=require&password=***," in err and "api_key=*** (sent Bearer ***)" in err
    for secret in SECRETS:
        assert secret not in err, secret
