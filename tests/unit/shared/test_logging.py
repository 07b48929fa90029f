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
"""
SECRETS = (
    "db-PASSWORD-1",
    "redis-PASSWORD-2",
    "tok-SECRET-3",
    "MY-PRIVATE-TEXT-4",
    "k-SECRET-5",
    "PROXY-PW-6",
)


def test_tracebacks_carry_no_locals_and_no_secrets() -> None:
    result = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True)
    lines = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert len(lines) == 3, result.stderr
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
