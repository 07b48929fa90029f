"""`fleet cli`: the embedded stack in the background, the terminal client (`tui/`) in the
foreground. The stack's processes log to `.fleet/logs/`, so the terminal belongs to the client;
the stack stops when the client exits."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from fleet_cli.embedded import Embedded, prepare_embedded, stack_failure, start_stack, stop_on_signals

MIN_NODE_MAJOR = 20
# The checkout's tui/ package: `fleet cli` runs from a clone (it is not in the images).
TUI_DIR = Path(__file__).resolve().parents[3] / "tui"


def node_binary() -> str | None:
    """`node` on PATH when it is at least MIN_NODE_MAJOR, else None."""
    node = shutil.which("node")
    if node is None:
        return None
    result = subprocess.run([node, "--version"], capture_output=True, text=True, check=False, timeout=10)
    match = re.match(r"v(\d+)\.", result.stdout.strip())
    return node if match and int(match.group(1)) >= MIN_NODE_MAJOR else None


def needs_build(tui: Path) -> bool:
    """dist/ is missing or older than a source file or the lock file."""
    entry = tui / "dist" / "main.js"
    if not entry.is_file():
        return True
    built = entry.stat().st_mtime
    sources = [tui / "package-lock.json", tui / "tsconfig.json", *(tui / "src").rglob("*.ts")]
    return any(path.stat().st_mtime > built for path in sources if path.is_file())


def build_client(tui: Path, log: Path) -> bool:
    """`npm ci` when node_modules is missing or stale, then `npm run build`; output to `log`."""
    npm = shutil.which("npm")
    if npm is None:
        return False
    lock, installed = tui / "package-lock.json", tui / "node_modules" / ".package-lock.json"
    steps = []
    if not installed.is_file() or installed.stat().st_mtime < lock.stat().st_mtime:
        steps.append([npm, "ci", "--no-audit", "--no-fund"])
    steps.append([npm, "run", "build"])
    with log.open("ab") as out:
        for step in steps:
            if subprocess.run(step, cwd=tui, stdout=out, stderr=subprocess.STDOUT, check=False).returncode:
                return False
    return True


def run_client(node: str, url: str, session: str | None) -> int:
    argv = [node, str(TUI_DIR / "dist" / "main.js"), "--api-url", url]
    if session:
        argv += ["--session", session]
    return subprocess.run(argv, check=False).returncode


def run_cli(*, profile: str | None, host: str, port: int, api_url: str | None, session: str | None) -> int:
    node = node_binary()
    if node is None:
        print(f"fleet: `fleet cli` needs Node.js {MIN_NODE_MAJOR} or newer on PATH", file=sys.stderr)
        return 2
    if not (TUI_DIR / "package.json").is_file():
        print(f"fleet: `fleet cli` runs from a fleet checkout ({TUI_DIR} is missing)", file=sys.stderr)
        return 2
    if api_url is not None:  # a gateway that is already running: just the client
        return client_only(node, api_url, session)
    prepared = prepare_embedded(profile, host, port)
    if isinstance(prepared, int):
        return prepared
    logs = prepared.data_dir / "logs"
    logs.mkdir(mode=0o700, exist_ok=True)  # the build's log goes there, before the stack starts
    if not ensure_built(logs / "tui-build.log"):
        return 1
    stack = prepared.stack
    # Ctrl-C before the client owns the terminal stops the start-up; the client itself reads
    # keys in raw mode, so no SIGINT arrives while it runs.
    stop_on_signals(stack)
    watcher: threading.Thread | None = None
    try:
        print(f"fleet: starting the stack (logs in {logs})...", file=sys.stderr, flush=True)
        url = start_stack(prepared, host=host, port=port, workers=1, logs=logs)
        if isinstance(url, int):
            return url
        watcher = threading.Thread(target=watch, args=(prepared, logs), daemon=True, name="fleet-watch")
        watcher.start()
        return run_client(node, url, session)
    finally:
        stack.stopping = True
        if watcher is not None:  # it may be restarting the Redis: let it finish before the stop
            watcher.join(timeout=15)
        stack.stop()
        print("fleet: stopped", file=sys.stderr)


def watch(prepared: Embedded, logs: Path) -> None:
    """While the client runs: keep the private Redis up, and note a process that ended (the
    client reconnects on its own when it can). Nothing goes to the terminal, which is the
    client's: notes go to fleet-cli.log."""
    stack = prepared.stack

    def note(line: str) -> None:
        with (logs / "fleet-cli.log").open("a") as out:
            out.write(f"{line}\n")

    while not stack.stopping:
        failed = stack_failure(stack, prepared.data_dir, note)
        if failed is not None:
            note(failed)
            return
        time.sleep(0.5)


def client_only(node: str, url: str, session: str | None) -> int:
    if not ensure_built(Path(tempfile.gettempdir()) / "fleet-tui-build.log"):
        return 1
    return run_client(node, url, session)


def ensure_built(log: Path) -> bool:
    """Build the client if its sources are newer than its build; False (said) when that fails."""
    if not needs_build(TUI_DIR):
        return True
    print("fleet: building the terminal client (once)...", file=sys.stderr, flush=True)
    if build_client(TUI_DIR, log):
        return True
    print(f"fleet: the client did not build; see {log}", file=sys.stderr)
    return False
