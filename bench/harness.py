"""What every lane shares: samples and their summaries, ABAB interleaving, goals, and the receipt
(git sha, machine, load, parameters, figures, ratios, goals) written to bench/receipts/."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECEIPTS = Path(__file__).resolve().parent / "receipts"


# --- samples ------------------------------------------------------------------------------------


def percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted samples (q in 0..1)."""
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summary(samples_s: list[float]) -> dict[str, Any]:
    """n, p50, p95, p99, mean, min, max of samples given in seconds, reported in ms."""
    ordered = sorted(samples_s)
    if not ordered:
        return {"n": 0}

    def ms(value: float) -> float:
        return round(value * 1000, 3)

    return {
        "n": len(ordered),
        "p50_ms": ms(percentile(ordered, 0.50)),
        "p95_ms": ms(percentile(ordered, 0.95)),
        "p99_ms": ms(percentile(ordered, 0.99)),
        "mean_ms": ms(sum(ordered) / len(ordered)),
        "min_ms": ms(ordered[0]),
        "max_ms": ms(ordered[-1]),
    }


def ratios(subject: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float | None]:
    """subject / baseline at p50, p95 and p99 (None when the baseline has no samples)."""
    out: dict[str, float | None] = {}
    for key in ("p50", "p95", "p99"):
        mine, theirs = subject.get(f"{key}_ms"), baseline.get(f"{key}_ms")
        out[f"ratio_{key}"] = round(mine / theirs, 3) if mine is not None and theirs else None
    return out


def compared(subject_s: list[float], baseline_s: list[float]) -> dict[str, Any]:
    """Both sides' summaries and the ratios between them."""
    mine, theirs = summary(subject_s), summary(baseline_s)
    return {"subject": mine, "baseline": theirs, **ratios(mine, theirs)}


def timed(call: Callable[[], Any]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def interleave(sides: dict[str, Callable[[], float]], *, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Run each side `warmup` times (discarded), then `repeats` rounds of A, B, A, B…; each call
    returns its own sample in seconds. The order within a round alternates (ABBA), so neither
    side always runs right after the other's cleanup."""
    names = list(sides)
    for _ in range(warmup):
        for name in names:
            sides[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for index in range(repeats):
        for name in names if index % 2 == 0 else reversed(names):
            samples[name].append(sides[name]())
    return samples


# --- goals --------------------------------------------------------------------------------------


def goal(name: str, target: str, measured: Any, met: bool | None, note: str = "") -> dict[str, Any]:
    """A goal is reported, never asserted. `met` None: not measurable in this run (say why in note)."""
    entry = {"goal": name, "target": target, "measured": measured, "met": met}
    if note:
        entry["note"] = note
    return entry


# --- machine and code ---------------------------------------------------------------------------


def memory_kb() -> dict[str, int]:
    found: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                found[key] = int(rest.split()[0])
    except OSError:
        pass
    return found


def machine() -> dict[str, Any]:
    memory = memory_kb()
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_total_mb": memory.get("MemTotal", 0) // 1024,
        "memory_available_mb": memory.get("MemAvailable", 0) // 1024,
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "loadavg": list(os.getloadavg()),
    }


def git() -> dict[str, Any]:
    def run(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    sha = run("rev-parse", "HEAD")
    status = run("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "dirty": bool(status) if status is not None else None}


# --- the receipt --------------------------------------------------------------------------------


@dataclass
class Receipt:
    """One lane's run. Fill `figures`, `ratios`, `goals` and `notes`; `finish()` adds the machine
    block (with the load before and after) and `write()` puts it in bench/receipts/."""

    lane: str
    parameters: dict[str, Any]
    baseline: str | None = None
    started: float = field(default_factory=time.time)
    load_before: list[float] = field(default_factory=lambda: list(os.getloadavg()))
    figures: dict[str, Any] = field(default_factory=dict)
    ratios: dict[str, Any] = field(default_factory=dict)
    goals: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None

    def finish(self) -> dict[str, Any]:
        mach = machine()
        mach["load_before"] = self.load_before
        mach["load_after"] = mach.pop("loadavg")
        body: dict[str, Any] = {
            "lane": self.lane,
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "duration_s": round(time.time() - self.started, 2),
            "git": git(),
            "machine": mach,
            "parameters": self.parameters,
            "baseline": self.baseline,
            "figures": self.figures,
            "ratios": self.ratios,
            "goals": self.goals,
            "notes": self.notes,
        }
        if self.skipped is not None:
            body["skipped"] = self.skipped
        return body

    def write(self, directory: Path | None = None) -> tuple[dict[str, Any], Path]:
        """Into `directory`, by default RECEIPTS (read at call time, so tests can move it)."""
        directory = directory or RECEIPTS
        body = self.finish()
        directory.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self.started))
        path = directory / f"{self.lane}-{stamp}.json"
        suffix = 1
        while path.exists():  # two runs of one lane in the same second
            suffix += 1
            path = directory / f"{self.lane}-{stamp}-{suffix}.json"
        path.write_text(json.dumps(body, indent=2) + "\n")
        return body, path

    def written(self) -> dict[str, Any]:
        """write() to the default folder; the body, with where it went as `receipt_path`."""
        body, path = self.write()
        body["receipt_path"] = str(path)
        return body


def latest_receipts(directory: Path | None = None) -> dict[str, tuple[Path, dict[str, Any]]]:
    """The newest receipt of each lane (by its `at`, then by when the file was written: two runs
    in one second share `at`, and `-2` sorts before `.json` by name)."""
    directory = directory or RECEIPTS
    found: dict[str, tuple[tuple[str, int], Path, dict[str, Any]]] = {}
    for path in sorted(directory.glob("*.json")):
        try:
            body = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        lane = body.get("lane")
        if not isinstance(lane, str):
            continue
        key = (str(body.get("at", "")), path.stat().st_mtime_ns)
        if lane not in found or key > found[lane][0]:
            found[lane] = (key, path, body)
    return {lane: (path, body) for lane, (_, path, body) in sorted(found.items())}


def start_baseline_module(
    name: str, module: str, port: int, cwd: Path, log: Path, **options: str
) -> subprocess.Popen[bytes]:
    """`python -m <module> --port <port> --<option> <value>…` as a baseline server."""
    argv = [sys.executable, "-m", module, "--port", str(port)]
    for option, value in options.items():
        argv += [f"--{option}", value]
    return start_baseline_server(name, argv, port, cwd, log)


def baseline_args(prog: str, *options: str) -> argparse.Namespace:
    """A baseline server's command line: `--port` and each of `options`, all required."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--port", type=int, required=True)
    for option in options:
        parser.add_argument(f"--{option}", required=True)
    return parser.parse_args()


def start_baseline_server(
    name: str, argv: list[str], port: int, cwd: Path, log: Path
) -> subprocess.Popen[bytes]:
    """A baseline server (`bench.relay`, `bench.first_byte_floor`) in its own process group, once
    its `GET /health` answers 200 on `port`; its output goes to `log`."""
    from bench.stack import stop_group

    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            stop_group(proc)  # a worker it forked may outlive it
            raise RuntimeError(f"the {name} exited with {proc.returncode}: {log.read_text()[-800:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
            if s.recv(64).startswith(b"HTTP/1.1 200"):
                return proc
        time.sleep(0.05)
    stop_group(proc)
    raise RuntimeError(f"the {name} never answered")
