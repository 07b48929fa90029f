"""The README's "Try a Turn", run literally against `fleet up` as a newcomer starts it: a
computed answer, a summarised attachment with its artifact downloaded, and a cancelled slow Turn.

The only change to the README's commands is the URL: `FLEET=` gets the port this test's
`fleet up` printed, as the README tells the reader to do."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO, free_port
from tests.e2e.test_fleet_up import newcomer_env, spawn_up, wait_for_banner

pytestmark = pytest.mark.e2e

README_URL_LINE = "FLEET=http://127.0.0.1:8000"


def try_a_turn_commands() -> str:
    """Every bash block from "### Try a Turn" up to the real-model paragraph, in order."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### Try a Turn") : readme.index("To use a real model")]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)
    assert len(blocks) >= 4, "the section lost its command blocks"
    return "\n".join(blocks)


def test_the_readme_quick_start_shows_an_answer_a_summary_and_a_cancel(tmp_path: Path) -> None:
    commands = try_a_turn_commands()
    assert commands.count(README_URL_LINE) == 1
    port = free_port()
    commands = commands.replace(README_URL_LINE, f"FLEET=http://127.0.0.1:{port}")
    stack_dir = tmp_path / "stack"
    stack_dir.mkdir(mode=0o711)
    scratch = tmp_path / "scratch"  # the README's mktemp files land here, not in /tmp
    scratch.mkdir()
    proc = spawn_up(stack_dir, newcomer_env(), port)
    try:
        wait_for_banner(proc, timeout=60)
        shell = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", commands],
            cwd=REPO,  # `-F attachment=@README.md` reads the clone's README, as for the reader
            env={**newcomer_env(), "TMPDIR": str(scratch)},
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=40)
    out = shell.stdout
    assert shell.returncode == 0, f"{shell.stderr[-3000:]}\n{out[-3000:]}"

    # 1. The computed answer, streamed and committed.
    assert '"delta":"37 * 91 = 3,367 (computed with Python in the sandbox)."' in out
    # 2. The summary: announced as an artifact, then downloaded whole.
    artifact = json.loads(re.search(r'data: (\{"type":"data-artifact".*\})', out).group(1))  # type: ignore[union-attr]
    assert artifact["data"]["name"] == "summary.md"
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    words = len(re.findall(r"[A-Za-z][A-Za-z'-]+", readme))
    assert f"README.md has {len(readme.splitlines()):,} lines and {words:,} words." in out
    assert f"# Summary\n\n## README.md\n\n- {len(readme.splitlines()):,} lines, {words:,} words" in out
    assert "> A production runtime for Recursive Language Models." in out
    # 3. The slow Turn: cancel accepted, its steps seen, its stream ended with abort.
    assert re.search(r'\{"run_id":"[0-9a-f-]{36}","state":"requested"\}', out)
    assert '"stdout":"starting a 5-step task' in out
    assert '{"type":"abort","reason":"Turn cancelled"}' in out
    assert "the squares of 0 to 4,999" not in out, "the slow Turn finished before it was cancelled"
    # The blocks after it still work: versions, the fork, a skill, the task checkpoint.
    assert "Nothing was attached to this Turn, so I read what earlier Turns attached." in out
