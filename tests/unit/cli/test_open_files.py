"""`fleet gateway` raises the open-files limit for its streams and never promises Granian more
connections than the limit allows."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import resource, sys
from fleet_cli.main import open_files_for, SPARE_FILES
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
allowed = open_files_for(int(sys.argv[1]))
print(allowed, resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard, SPARE_FILES)
"""


def run(connections: int) -> tuple[int, int, int, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(connections)], capture_output=True, text=True, check=True
    )
    allowed, soft, hard, spare = (int(x) for x in out.stdout.split())
    return allowed, soft, hard, spare


def test_the_limit_is_raised_to_fit_the_connections() -> None:
    allowed, soft, hard, spare = run(2000)
    if hard >= 2000 + spare:
        assert allowed == 2000 and soft == 2000 + spare
    else:  # a hard limit below the need: promise only what fits
        assert allowed == hard - spare and soft == hard


def test_a_hard_limit_bounds_the_promise() -> None:
    allowed, soft, hard, spare = run(10_000_000)
    assert soft <= hard and allowed <= soft - spare
