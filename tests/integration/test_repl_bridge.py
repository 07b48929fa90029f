"""`repl_bridge.py` on its own, around a stand-in REPL: the order of what it puts on its stdout."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import sys
from pathlib import Path

BRIDGE = Path(__file__).resolve().parents[2] / "worker/src/fleet_worker/sandbox/repl_bridge.py"

# Stands in for repl_main.py: like a cell, it writes its output, then (like the supervisor) a frame.
STAND_IN = """
import os, sys
output = int(sys.argv[sys.argv.index("--output-fd") + 1])
for index in range(200):
    os.write(output, b"." * 20_000 + b"out %d;" % index)  # base64 work for the bridge, at its tail
    os.write(1, b"frame %d;" % index)
"""


def test_output_written_before_a_frame_is_on_the_wire_before_it(tmp_path: Path) -> None:
    # The host reads a cell's result frame and then the output it holds: output behind the frame
    # would be cut from its cell and shown in the next one's.
    shutil.copy(BRIDGE, tmp_path / "repl_bridge.py")
    (tmp_path / "repl_main.py").write_text(STAND_IN)
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(tmp_path / "repl_bridge.py")],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
        check=True,
    )
    seen_output = b""
    frames = 0
    for line in done.stdout.splitlines():
        kind, _, payload = line.partition(b" ")
        data = base64.b64decode(payload)
        if kind == b"O":
            seen_output += data
            continue
        for number in re.findall(rb"frame (\d+);", data):
            assert b"out %s;" % number in seen_output, f"frame {number.decode()} came before its output"
            frames += 1
    assert frames == 200 and seen_output.count(b";") == 200
