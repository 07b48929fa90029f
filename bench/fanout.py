"""Lane `fanout`: one gateway process, N SSE streams on one Run; events are published into the
Run's log the way the worker does (`RunLog.append` under the Run's lease), each stamped with its
publish time. Measured: streams held, delivery latency per event per stream against a raw
redis-py pub/sub subscriber on the same channel (same events, same moment), gateway CPU per
delivered event (/proc of the gateway's process tree, idle CPU subtracted), and its RSS.

No worker runs: the Turn stays queued, and the bench holds its lease in the worker's place.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import fanout_floor, relay
from bench import stack as fleet_stack
from bench.harness import REPO, Receipt, goal, summary

DEFAULT_STREAMS = (100, 500, 1000, 2000, 5000)
QUICK_STREAMS = (50, 200)
# The three servers of a level, in an order that rotates level by level.
ROTATIONS = (("gateway", "asgi_floor", "relay"), ("asgi_floor", "relay", "gateway"),
             ("relay", "gateway", "asgi_floor"))  # fmt: skip
MIN_DELIVERIES = 25_000  # per level: at 100 streams, 250 events instead of 50
STREAMS_PER_CLIENT = 1000  # receivers per client process (they share the 2 cores with the gateway)


def open_turn(st: fleet_stack.Stack) -> str:
    """A queued Turn (no worker takes it): POST, read the headers for the run id, hang up."""
    import http.client

    session = fleet_stack.new_session(st.url)
    conn = http.client.HTTPConnection("127.0.0.1", st.port, timeout=30)
    try:
        conn.request(
            "POST", f"/api/sessions/{session}/turns", body=json.dumps({"text": "fanout"}),
            headers={"content-type": "application/json", "Idempotency-Key": uuid.uuid4().hex},
        )  # fmt: skip
        response = conn.getresponse()
        run_id = response.getheader("X-Fleet-Run-ID")
    finally:
        conn.close()
    if response.status != 200 or not run_id:
        raise RuntimeError(f"POST turns answered {response.status}")
    return run_id


async def publish(
    redis_url: str, run_id: str, events: int, interval: float, gateway: list[int]
) -> dict[str, float]:
    """E stamped events, then (once the gateway's CPU settles) the terminal event.
    Returns the gateway's CPU seconds spent on the E events, idle CPU subtracted."""
    from redis.asyncio import Redis

    from fleet_shared.event_log import RunLog, lease_token
    from fleet_shared.events import RunCompleted, StatusChanged

    redis = Redis.from_url(redis_url)
    try:
        log = RunLog(redis)
        token = lease_token(1, "bench")
        if not await log.take_lease(run_id, token, 600_000):
            raise RuntimeError("could not take the Run's lease")
        idle_start, idle_at = fleet_stack.cpu_seconds(gateway), time.monotonic()
        await asyncio.sleep(1.0)
        idle_rate = (fleet_stack.cpu_seconds(gateway) - idle_start) / (time.monotonic() - idle_at)
        cpu_start, started = fleet_stack.cpu_seconds(gateway), time.monotonic()
        for index in range(events):
            message = f"bench:{index}:{time.monotonic_ns()}:"
            event = StatusChanged(run_id=run_id, seq=index + 1, phase="execution", message=message)
            await log.append(event, token)
            await asyncio.sleep(interval)
        previous = fleet_stack.cpu_seconds(gateway)
        for _ in range(300):  # until the gateway has written everything out (≤ 30 s)
            await asyncio.sleep(0.1)
            current = fleet_stack.cpu_seconds(gateway)
            if current - previous <= 0.011:  # about one clock tick: idle again
                break
            previous = current
        cpu = fleet_stack.cpu_seconds(gateway) - cpu_start
        elapsed = time.monotonic() - started
        await log.append(RunCompleted(run_id=run_id, seq=events + 1, duration_ms=1), token)
        return {"cpu_s": cpu, "elapsed_s": elapsed, "idle_cpu_s": idle_rate * elapsed}
    finally:
        await redis.aclose()


def spawn_receiver(out: Path, events: int, *args: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "bench.fanout_client", "--events", str(events), "--out", str(out), *args]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True, cwd=REPO)


@dataclass
class Server:
    """What the streams connect to: the gateway, or the relay baseline."""

    name: str
    port: int
    pid: int
    path: Callable[[str], str]  # run id -> the stream's path


def one_level(
    st: fleet_stack.Stack, server: Server, streams: int, *, events: int, interval: float, hold: float
) -> dict[str, Any]:
    from fleet_shared.redis_keys import events_channel

    run_id = open_turn(st)
    tmp = Path(tempfile.mkdtemp(prefix="fleet-bench-fanout-"))
    receivers: list[subprocess.Popen[str]] = []
    try:
        raw_out = tmp / "raw.json"
        raw = spawn_receiver(
            raw_out, events, "--raw", "--redis", st.redis_url, "--channel", events_channel(0)
        )
        receivers.append(raw)
        outs: list[Path] = []
        remaining = streams
        while remaining > 0:
            count = min(STREAMS_PER_CLIENT, remaining)
            out = tmp / f"streams-{len(outs)}.json"
            receivers.append(spawn_receiver(
                out, events, "--port", str(server.port), "--path", server.path(run_id),
                "--streams", str(count), "--hold-seconds", str(hold),
            ))  # fmt: skip
            outs.append(out)
            remaining -= count
        held = 0
        for proc in receivers:
            assert proc.stdout is not None
            line = proc.stdout.readline().split()
            if proc is not raw:
                held += int(line[1]) if len(line) == 2 and line[0] == "ready" else 0
        tree = fleet_stack.process_tree(server.pid)
        rss = fleet_stack.rss_bytes(tree)
        cpu = asyncio.run(publish(st.redis_url, run_id, events, interval, tree))
        for proc in receivers:
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                fleet_stack.stop_group(proc)  # type: ignore[arg-type]
        raw_result = json.loads(raw_out.read_text())
        latencies: list[float] = []
        completed = 0
        for out in outs:
            if out.exists():
                result = json.loads(out.read_text())
                latencies += result["latencies"]
                completed += result["completed"]
    finally:
        for proc in receivers:
            fleet_stack.stop_group(proc)  # type: ignore[arg-type]
        shutil.rmtree(tmp, ignore_errors=True)
    sse, base = summary(latencies), summary(raw_result["latencies"])
    busy = max(0.0, cpu["cpu_s"] - cpu["idle_cpu_s"])
    return {
        "server": server.name,
        "streams": streams,
        "held": held,
        "completed": completed,
        "events": events,
        "delivered": len(latencies),
        "expected_deliveries": streams * events,
        "sse": sse,
        "raw": base,
        "ratio_p50": round(sse["p50_ms"] / base["p50_ms"], 3) if sse["n"] and base["n"] else None,
        "ratio_p99": round(sse["p99_ms"] / base["p99_ms"], 3) if sse["n"] and base["n"] else None,
        "cpu_s": round(cpu["cpu_s"], 4),
        "idle_cpu_s": round(cpu["idle_cpu_s"], 4),
        "cpu_us_per_delivery": round(busy / len(latencies) * 1e6, 3) if latencies else None,
        # One process hands an event to its streams one after another: the last one cannot have
        # it sooner than this after the first (a floor for the spread of delivery latencies).
        "serial_fanout_ms": round(busy / len(latencies) * streams * 1e3, 3) if latencies else None,
        "deliveries_per_cpu_s": round(len(latencies) / busy) if busy > 0 and latencies else None,
        "rss_mb_held": round(rss / 2**20, 1),
        "processes": len(tree),
        "write_floor_us": write_floor(streams, events, interval) if server.name == "gateway" else None,
    }


def write_floor(streams: int, events: int, interval: float) -> float | None:
    """CPU per bare loopback send at this level (bench/write_floor.py), in a process of its own."""
    argv = [sys.executable, "-m", "bench.write_floor", "--streams", str(streams), "--events", str(events),
            "--interval", str(interval)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=300, check=False)
    if done.returncode != 0:
        return None
    return float(json.loads(done.stdout)["cpu_us_per_send"])


def serial_note(by_n: dict[int, dict[str, Any]], floored: dict[int, dict[str, Any]]) -> list[str]:
    """Why p99 at 2,000 streams stays far above a raw subscriber's: the serial fan-out floor."""
    at_2000 = by_n.get(2000)
    if at_2000 is None or at_2000["serial_fanout_ms"] is None or not at_2000["raw"].get("n"):
        return []
    allowed_ms = 1.5 * at_2000["raw"]["p99_ms"]
    return [
        f"p99_at_2000: one gateway process spends {at_2000['cpu_us_per_delivery']} µs of CPU per "
        f"delivery, so handing one event to 2,000 streams takes it {at_2000['serial_fanout_ms']} ms "
        f"(serial_fanout_ms), against a raw subscriber's p99 of {at_2000['raw']['p99_ms']} ms for one "
        f"delivery; 1.5 x raw would need every stream served within {round(allowed_ms, 3)} ms, i.e. "
        f"under {round(allowed_ms / 2000 * 1000, 3)} µs per delivery in one process. Streams spread "
        "over gateway processes (Granian workers, replicas) divide the spread",
        *floor_line(at_2000, allowed_ms),
        *asgi_floor_line(floored.get(2000)),
    ]


def asgi_floor_line(floor: dict[str, Any] | None) -> list[str]:
    if floor is None or floor["ratio_p99"] is None:
        return []
    return [
        f"p99_at_2000: the bare ASGI server on Granian (bench/fanout_floor.py, no framework) reached "
        f"{floor['ratio_p99']} x raw at 2,000 streams in the same run (p99 {floor['sse']['p99_ms']} "
        f"ms, {floor['cpu_us_per_delivery']} µs of CPU per delivery)"
    ]


def floor_line(at_2000: dict[str, Any], allowed_ms: float) -> list[str]:
    floor = at_2000.get("write_floor_us")
    if floor is None:
        return []
    return [
        f"p99_at_2000: the same run's write floor (a bare loopback send per stream, no HTTP, no "
        f"server) is {floor} µs per delivery, so one process only writing one event to 2,000 "
        f"connections takes {round(floor * 2000 / 1000, 3)} ms, against the {round(allowed_ms, 3)} ms "
        "that 1.5 x raw allows"
    ]


def floor_note(results: list[dict[str, Any]]) -> str:
    """The same run's floors beside the gateway's CPU, level by level."""

    def shown(value: object) -> str:
        return "-" if value is None else str(value)

    rows = [f"{r['streams']}: {shown(r['cpu_us_per_delivery'])} vs {shown(r.get('asgi_floor_us'))} vs "
            f"{shown(r['write_floor_us'])}" for r in results]  # fmt: skip
    if not rows:
        return ""
    return (
        "gateway µs per delivery vs the bare ASGI server's on Granian (asgi_floor_us, "
        "bench/fanout_floor.py: no framework, one task wake-up and one send per stream per event) vs "
        "a bare loopback send's (write_floor_us, no HTTP, no Python server), by level: " + "; ".join(rows)
    )


def relay_ratio(fleet: dict[str, Any], relay: dict[str, Any] | None) -> float | None:
    """fleet's deliveries per CPU-second over the relay's, at one level (None if not comparable)."""
    if relay is None or not fleet["deliveries_per_cpu_s"] or not relay["deliveries_per_cpu_s"]:
        return None
    return round(float(fleet["deliveries_per_cpu_s"]) / float(relay["deliveries_per_cpu_s"]), 3)


def baseline_stream_path(run_id: str) -> str:
    """A Run's stream on the relay and the ASGI floor (the gateway's is under /api)."""
    return f"/runs/{run_id}/stream"


def measure_levels(
    levels: tuple[int, ...], *, events: int, min_deliveries: int, interval: float, hold: float,
    with_relay: bool,
) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:  # fmt: skip
    """Each level on the gateway, the bare ASGI floor and (`with_relay`) the relay: the gateway's
    results, and the others' by stream count. A level publishes `events`, or more, so that its
    streams take at least `min_deliveries` in all (a figure per delivery needs enough of them)."""
    from fleet_shared.redis_keys import events_channel

    results: list[dict[str, Any]] = []
    relayed: dict[int, dict[str, Any]] = {}
    floored: dict[int, dict[str, Any]] = {}
    with fleet_stack.stack(heartbeat_seconds=60) as st, contextlib.ExitStack() as servers:
        st.start_redis()
        st.migrate()
        st.start_gateway()
        st.wait_ready(need_worker=False)
        assert st.gateway is not None
        channel, logs = events_channel(0), st.root / "logs"
        own = Server("gateway", st.port, st.gateway.pid, lambda run: f"/api/runs/{run}/stream")
        by_name = {"gateway": own}
        port = fleet_stack.free_port()
        floor_proc = fanout_floor.start(st.redis_url, channel, port, REPO, logs / "fanout-floor.log")
        servers.callback(fleet_stack.stop_group, floor_proc)
        by_name["asgi_floor"] = Server("asgi_floor", port, floor_proc.pid, baseline_stream_path)
        if with_relay:
            port = fleet_stack.free_port()
            relay_proc = relay.start(st.redis_url, channel, port, REPO, logs / "relay.log")
            servers.callback(fleet_stack.stop_group, relay_proc)
            by_name["relay"] = Server("relay", port, relay_proc.pid, baseline_stream_path)
        for index, streams_n in enumerate(levels):
            level_events = max(events, math.ceil(min_deliveries / streams_n))
            # The servers take turns, the order rotating by level, so drift hits them all.
            for name in ROTATIONS[index % len(ROTATIONS)]:
                if name not in by_name:
                    continue
                server = by_name[name]
                result = one_level(st, server, streams_n, events=level_events, interval=interval, hold=hold)
                if name == "gateway":
                    results.append(result)
                else:
                    (floored if name == "asgi_floor" else relayed)[streams_n] = result
    return results, relayed, floored


def run(
    *, quick: bool = False, streams: tuple[int, ...] | None = None, events: int | None = None,
    interval: float = 0.02,
) -> dict[str, Any]:  # fmt: skip
    levels = streams or (QUICK_STREAMS if quick else DEFAULT_STREAMS)
    events = events or (20 if quick else 50)
    hold = 15.0 if quick else 30.0
    min_deliveries = 0 if quick else MIN_DELIVERIES
    receipt = Receipt(
        "fanout",
        {"streams": list(levels), "events_per_level": events, "min_deliveries_per_level": min_deliveries,
         "interval_s": interval, "hold_seconds": hold,
         "streams_per_client_process": STREAMS_PER_CLIENT, "gateway_workers": 1},
        baseline="a raw redis-py pub/sub subscriber on the same channel (its own process); for throughput, "
        "a minimal FastAPI + sse-starlette relay (bench/relay.py); for CPU, a bare ASGI server on Granian "
        "(bench/fanout_floor.py) and a bare loopback send (bench/write_floor.py)",
    )  # fmt: skip
    missing = relay.available()
    if missing:
        receipt.notes.append(f"relay baseline skipped: {missing}")
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the servers inherit it
    results, relayed, floored = measure_levels(
        levels,
        events=events,
        min_deliveries=min_deliveries,
        interval=interval,
        hold=hold,
        with_relay=not missing,
    )
    for r in results:
        floor = floored.get(r["streams"])
        r["asgi_floor_us"] = floor["cpu_us_per_delivery"] if floor else None
        r["cpu_vs_asgi_floor"] = (
            round(r["cpu_us_per_delivery"] / r["asgi_floor_us"], 3)
            if r["cpu_us_per_delivery"] and r["asgi_floor_us"] else None
        )  # fmt: skip
    receipt.figures = {
        "levels": results,
        "relay_levels": list(relayed.values()),
        "asgi_floor_levels": list(floored.values()),
    }
    receipt.ratios = {f"p99_vs_raw@{r['streams']}": r["ratio_p99"] for r in results}
    for r in results:
        ratio = relay_ratio(r, relayed.get(r["streams"]))
        if ratio is not None:
            receipt.ratios[f"throughput_vs_relay@{r['streams']}"] = ratio
        if r["cpu_vs_asgi_floor"] is not None:
            receipt.ratios[f"cpu_vs_asgi_floor@{r['streams']}"] = r["cpu_vs_asgi_floor"]
    by_n = {r["streams"]: r for r in results}
    biggest = max(levels)
    at = 2000 if 2000 in relayed else max(relayed, default=None)
    vs_relay = relay_ratio(by_n[at], relayed[at]) if at is not None else None
    cpu = [r["cpu_us_per_delivery"] for r in results if r["cpu_us_per_delivery"] is not None]
    receipt.goals = [
        goal("streams_held", "5,000 streams held", {"streams": biggest, "held": by_n[biggest]["held"]},
             by_n[biggest]["held"] >= 5000 if biggest >= 5000 else None,
             "" if biggest >= 5000 else f"not measured: the largest level was {biggest}"),
        goal("p99_at_2000", "p99 ≤ 1.5 x raw at 2,000 streams",
             by_n[2000]["ratio_p99"] if 2000 in by_n else None,
             (by_n[2000]["ratio_p99"] or 1e9) <= 1.5 if 2000 in by_n else None,
             "" if 2000 in by_n else "not measured: no 2,000-stream level in this run"),
        goal("cpu_per_delivery", "≤ 10 µs gateway CPU per delivered event (worst level)",
             max(cpu) if cpu else None, max(cpu) <= 10 if cpu else None, floor_note(results)),
        goal("relay_throughput", "≥ 2x the FastAPI + sse-starlette relay's deliveries per CPU-second",
             {"streams": at, "ratio": vs_relay}, vs_relay >= 2 if vs_relay is not None else None,
             missing or ("" if at == 2000 else f"measured at {at} streams: no 2,000-stream level")),
    ]  # fmt: skip
    receipt.notes.append(
        "latency = receive time - publish time (CLOCK_MONOTONIC, shared by all processes); the receivers "
        "run on the same 2 cores as the server, so at high N part of the SSE latency is the clients' own"
    )
    receipt.notes.extend(serial_note(by_n, floored))
    receipt.notes.append(
        "relay: bench/relay.py, FastAPI + sse-starlette on uvicorn, one process, one redis-py pub/sub "
        "connection per stream; asgi_floor: bench/fanout_floor.py, a bare ASGI app on Granian set up as "
        "the gateway is (one pub/sub connection per process, one future per stream); each level runs "
        "the gateway, the floor and the relay one after the other (the order rotating by level) on Runs "
        "of their own; throughput = delivered events per CPU-second of the serving process, idle CPU "
        "subtracted"
    )
    return receipt.written()
