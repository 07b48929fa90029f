"""Lane `workspace`: what versioned workspaces add to a Turn. A workspace is a version (a manifest
whose files are objects in the store); a lease starts by materialising it into the worker's
folder, and a Run settles by capturing the next one, storing the files it changed.

- `lease_start_<shape>`: the local provider's `acquire` with the version's manifest, in four
  states of the worker, interleaved round by round: `warm` (the folder holds the version and the
  worker knows it: only the check), `restarted` (the folder and the content cache hold it, but a
  restarted worker has no record: every file is copied again from the cache), `cold` (an empty
  folder and an empty cache: every object is fetched from the store), and `today`, the same
  `acquire` without a manifest (what a lease start did before versions), on a folder holding
  the same files. Shapes: `small` (1,000 small files) and `large` (the same plus one 100 MiB
  file); their file counts and bytes are in `parameters.shapes`.
- `settlement`: `lease.capture()` of a held lease with nothing changed, with one small file
  changed (of 1,000), and with the 100 MiB file changed (one write to it), interleaved; and
  `walk_small`, the bare walk (fleet_shared.confined.walk) of the same 1,000 files, the floor of
  every check that looks at each file.
- `store_get`: one small object's GET from the store, for scale: a cold lease start fetches one
  object after another.
- `turn_<workspace>_delay_<s>` (with `base`): `bench.ab`'s two kinds of Turn on this checkout
  and on `base` (the code before versions), side by side: with an empty workspace and with the
  long session's workspace holding 1,000 files (written by one untimed Turn, unchanged by the
  others), at zero delay, then with a delay on every scripted LM line. The goals are the warm
  Turn's p50 difference in both workspaces.

The store is moto's S3 server on loopback, in a process of its own (bench/object_store.py): its
answers come in about a millisecond, where a real S3 store takes tens of milliseconds per
request, so the cold figures here are a floor.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench import ab
from bench.harness import Receipt, goal, interleave, summary, timed
from bench.object_store import aws_environment, blob_store, moto_available, s3_on_loopback
from fleet_shared.config_file import StorageSection
from fleet_shared.confined import walk
from fleet_shared.manifests import Manifest, object_key
from fleet_worker.sandbox.boundary import Caps
from fleet_worker.sandbox.jail import LocalSandboxConfig
from fleet_worker.sandbox.lease import LocalSandboxLease
from fleet_worker.sandbox.local import LocalSandboxProvider
from fleet_worker.sandbox.removal import remove_tree
from fleet_worker.sandbox.sync import VersionedFolders
from fleet_worker.workspace_objects import WorkspaceObjects

LARGE_FILE = "memory/big.bin"
STATES = ("today", "warm", "restarted", "cold")
GOAL_MS = 5.0


def small_files(count: int, seed: int = 28) -> Iterator[tuple[str, bytes]]:
    """`count` notes of 512 B to 4 KiB, a hundred to a folder, each its own content."""
    rng = random.Random(seed)
    for index in range(count):
        yield f"memory/notes/d{index // 100:02d}/n{index:04d}.md", rng.randbytes(rng.randint(512, 4096))


def write_file(folder: Path, relative: str, data: bytes) -> None:
    path = folder / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def write_large(folder: Path, relative: str, mib: int) -> None:
    path = folder / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as out:
        for _ in range(mib):
            out.write(os.urandom(2**20))


class Bench:
    """One provider over the store, and the versions the lane measures with."""

    def __init__(self, root: Path, blobs: Any) -> None:
        self.root = root
        self.blobs = blobs
        self.cache_bytes = StorageSection().workspace_cache_mb * 2**20
        self.cfg = LocalSandboxConfig(pool_size=0)  # no warm REPL starts behind a sample's back
        self.warm = self.versions(root / "cache")
        workspaces = root / "workspaces"
        workspaces.mkdir(mode=0o711)
        self.provider = LocalSandboxProvider(self.cfg, caps=Caps(), workspaces=workspaces, versions=self.warm)
        self.runs = itertools.count()

    def versions(self, cache: Path) -> VersionedFolders:
        """A worker's folders over the content cache in `cache` (a new one: what a worker that
        (re)started knows, which is nothing but its cache on disk)."""
        objects = WorkspaceObjects(self.blobs, cache, self.cache_bytes)
        return VersionedFolders(objects, self.cfg.workspace_files)

    def folder(self, workspace: str) -> Path:
        assert self.provider.workspaces is not None
        return self.provider.workspaces / workspace

    def acquire(self, workspace: str, manifest: Manifest | None, versions: VersionedFolders) -> float:
        """One lease start, timed; then its REPL (started in the background by the lease) is let
        start and the lease released, so no spawn runs into the next sample."""
        self.provider.versions = versions
        started = time.perf_counter()
        lease = self.provider.acquire(workspace, f"run-{next(self.runs)}", "", manifest)
        elapsed = time.perf_counter() - started
        self.provider.versions = self.warm
        try:
            lease.interpreter_factory().start()
        finally:
            lease.release()
        return elapsed

    def held(self, workspace: str, manifest: Manifest) -> LocalSandboxLease:
        """A lease kept for captures, its REPL up and idle."""
        lease = self.provider.acquire(workspace, f"run-{next(self.runs)}", "", manifest)
        lease.interpreter_factory().start()
        return lease

    def close(self) -> None:
        self.provider.close()


def seeded(bench: Bench, name: str, files: int, large_mib: int) -> tuple[Manifest, float]:
    """The version a shape's Runs start from: its files written, then captured (every object
    put in the store). The manifest, and how long that first capture took."""
    folder = bench.root / f"seed-{name}"
    for relative, data in small_files(files):
        write_file(folder, relative, data)
    if large_mib:
        write_large(folder, LARGE_FILE, large_mib)
    started = time.perf_counter()
    captured = bench.warm.capture(folder, {}, lambda _size: None, frozenset())
    elapsed = time.perf_counter() - started
    shutil.rmtree(folder)
    return captured.manifest, elapsed


def lease_starts(bench: Bench, name: str, manifest: Manifest, rounds: int, warmup: int) -> dict[str, Any]:
    """The four states of a lease start, interleaved (see the module's docstring)."""
    for state in ("today", "warm"):  # their folders hold the version before the first sample
        bench.acquire(f"{name}-{state}", manifest, bench.warm)
    colds = itertools.count()

    def restarted() -> float:
        return bench.acquire(f"{name}-restarted", manifest, bench.versions(bench.root / "cache"))

    def cold() -> float:
        workspace, cache = f"{name}-cold", bench.root / f"cache-cold-{next(colds)}"
        with contextlib.suppress(FileNotFoundError):
            remove_tree(bench.folder(workspace))
        try:
            return bench.acquire(workspace, manifest, bench.versions(cache))
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    sides: dict[str, Callable[[], float]] = {
        "today": lambda: bench.acquire(f"{name}-today", None, bench.warm),
        "warm": lambda: bench.acquire(f"{name}-warm", manifest, bench.warm),
        "restarted": restarted,
        "cold": cold,
    }
    samples = interleave(sides, warmup=warmup, repeats=rounds)
    figures: dict[str, Any] = {state: summary(samples[state]) for state in STATES}
    today = figures["today"]["p50_ms"]
    figures["over_today_p50_ms"] = {
        state: round(figures[state]["p50_ms"] - today, 3) for state in STATES if state != "today"
    }
    return figures


def settlements(bench: Bench, small: Manifest, large: Manifest, rounds: int, warmup: int) -> dict[str, Any]:
    """Captures of two held leases, interleaved: nothing changed, one small file changed, the
    large file changed. Each change is made (untimed) just before its capture."""
    small_lease, large_lease = bench.held("settle-small", small), bench.held("settle-large", large)
    small_folder, large_folder = bench.folder("settle-small"), bench.folder("settle-large")
    notes = [entry.path for entry in small.entries]
    edits = itertools.count()
    big = large.by_path()[LARGE_FILE].sha256
    seed_big = big

    def timed_capture(lease: LocalSandboxLease) -> float:
        return timed_captured(lease)[0]

    def one_small() -> float:
        edit = next(edits)
        relative = notes[edit % len(notes)]
        (small_folder / relative).write_bytes(random.Random(edit).randbytes(2048))
        return timed_capture(small_lease)

    def one_large() -> float:
        nonlocal big
        edit = next(edits)
        with open(large_folder / LARGE_FILE, "r+b") as handle:  # one write: the whole file is new
            handle.write(edit.to_bytes(8, "big"))
        elapsed, manifest = timed_captured(large_lease)
        if big != seed_big:  # the last sample's object: only this lane's versions name it
            asyncio.run(bench.blobs.delete(object_key(big)))
        big = manifest.by_path()[LARGE_FILE].sha256
        return elapsed

    try:
        samples = interleave(
            {
                "unchanged_small": lambda: timed_capture(small_lease),
                "one_small_changed": one_small,
                "unchanged_large": lambda: timed_capture(large_lease),
                "one_large_changed": one_large,
                "walk_small": lambda: timed(lambda: collections.deque(walk(small_folder), maxlen=0)),
            },
            warmup=warmup,
            repeats=rounds,
        )
    finally:
        small_lease.release()
        large_lease.release()
    return {name: summary(values) for name, values in samples.items()}


def timed_captured(lease: LocalSandboxLease) -> tuple[float, Manifest]:
    started = time.perf_counter()
    captured = lease.capture()
    return time.perf_counter() - started, captured.manifest


def store_gets(bench: Bench, manifest: Manifest, count: int) -> dict[str, Any]:
    """GETs of small objects straight from the store (no cache): what a cold lease start pays
    once per file, one after another."""
    import io

    entries = [entry for entry in manifest.entries if entry.path != LARGE_FILE][:count]
    samples = []
    for entry in entries:
        started = time.perf_counter()
        bench.blobs.download(object_key(entry.sha256), io.BytesIO())
        samples.append(time.perf_counter() - started)
    return summary(samples)


def shape_of(manifest: Manifest) -> dict[str, int]:
    return {"files": len(manifest.entries), "bytes": manifest.byte_size}


def run(
    *,
    quick: bool = False,
    files: int = 1000,
    large_mib: int = 100,
    rounds: int | None = None,
    base: Path | None = None,
    base_python: str | None = None,
    turn_repeats: int | None = None,
    delay_s: float = 0.2,
) -> dict[str, Any]:
    """`base`: a checkout of the code before versions, for the Turn's goal (its interpreter is
    `base_python`, by default its `.venv`'s); without it the goal is not measured."""
    rounds = rounds if rounds is not None else (3 if quick else 20)
    turn_repeats = turn_repeats if turn_repeats is not None else (4 if quick else 200)
    receipt = Receipt(
        "workspace",
        {"files": files, "large_mib": large_mib, "rounds": rounds, "large_rounds": max(1, rounds // 2),
         "store": "moto's S3 server on loopback (its own process)", "base": str(base) if base else None,
         "turn_runs": turn_runs(files, delay_s, turn_repeats) if base else []},
        baseline="lease start: the same acquire without a manifest (before versions); the Turn: "
        "the same Turns on the code before versions (bench.ab), side by side",
    )  # fmt: skip
    if not moto_available():
        receipt.skipped = "moto is not installed (the dev dependency group): no S3 store to measure against"
        return receipt.written()
    root = Path(tempfile.mkdtemp(prefix="fleet-bench-workspace-"))
    root.chmod(0o711)  # the sandbox's uid must reach the workspaces
    try:
        measure_store(receipt, root, files=files, large_mib=large_mib, rounds=rounds, warmup=1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if base is not None:
        warmup = 2 if quick else 5
        measure_turns(
            receipt, base, base_python, files=files, repeats=turn_repeats, warmup=warmup, delay_s=delay_s
        )
    else:
        receipt.goals.append(turn_goal("warm_turn", "an empty workspace", None))
        receipt.goals.append(turn_goal("warm_turn_files", f"{files} files", None))
    return receipt.written()


def measure_store(
    receipt: Receipt, root: Path, *, files: int, large_mib: int, rounds: int, warmup: int
) -> None:
    with s3_on_loopback(root / "moto.log") as endpoint, aws_environment(endpoint):
        bench = Bench(root, blob_store(root / "data"))
        try:
            small, small_seed = seeded(bench, "small", files, 0)
            large, large_seed = seeded(bench, "large", files, large_mib)
            receipt.parameters["shapes"] = {"small": shape_of(small), "large": shape_of(large)}
            receipt.figures["store_get"] = store_gets(bench, small, min(200, files))
            receipt.figures["lease_start_small"] = lease_starts(bench, "small", small, rounds, warmup)
            large_rounds = max(1, rounds // 2)
            receipt.figures["lease_start_large"] = lease_starts(bench, "large", large, large_rounds, warmup)
            receipt.figures["settlement"] = settlements(bench, small, large, rounds, warmup)
            receipt.figures["first_capture_ms"] = {  # one sample each: every file new
                "small": round(small_seed * 1000, 1),
                "large": round(large_seed * 1000, 1),
            }
        finally:
            bench.close()
    receipt.notes.extend(store_notes(receipt.figures, receipt.parameters["shapes"]))


def store_notes(figures: dict[str, Any], shapes: dict[str, dict[str, int]]) -> list[str]:
    get = figures["store_get"]["p50_ms"]
    small, large = figures["lease_start_small"], figures["lease_start_large"]
    cold_small = small["cold"]["p50_ms"]
    per_file = cold_small / shapes["small"]["files"]
    return [
        f"lease_start: cold (empty folder, empty cache, every object from the store) took "
        f"{cold_small} ms p50 for {shapes['small']['files']} files of {shapes['small']['bytes']} bytes "
        f"and {large['cold']['p50_ms']} ms for {shapes['large']['files']} files of "
        f"{shapes['large']['bytes']} bytes; warm (the folder holds the version) "
        f"{small['warm']['p50_ms']} / {large['warm']['p50_ms']} ms against {small['today']['p50_ms']} / "
        f"{large['today']['p50_ms']} ms for the same acquire without a manifest.",
        f"store: one small object's GET from moto on loopback takes {get} ms p50 (store_get); the "
        f"cold lease start spent {per_file:.2f} ms per file. Objects are fetched one after another, "
        f"so against a real S3 store, whose GETs take tens of ms each, a cold start of "
        f"{shapes['small']['files']} files would take about that many times one GET: at 20 ms, "
        f"{shapes['small']['files'] * 20 / 1000:.0f} s.",
        "settlement: `lease.capture()` without a quota check (the Turn reads the stored bytes from "
        "the database first: that read is in the Turn's figures, not here).",
    ]


def turn_runs(files: int, delay_s: float, repeats: int) -> list[tuple[str, float, int, int]]:
    """(figure name, LM delay, files in the long session's workspace, rounds) of each comparison:
    an empty workspace and one of `files` files at zero delay, then the latter at `delay_s` (a
    quarter of the rounds: each is that much longer)."""
    return [
        ("turn_empty_delay_0", 0.0, 0, repeats),
        (f"turn_files_{files}_delay_0", 0.0, files, repeats),
        (f"turn_files_{files}_delay_{delay_s:g}", delay_s, files, max(1, repeats // 4)),
    ]


def measure_turns(
    receipt: Receipt, base: Path, python: str | None, *, files: int, repeats: int, warmup: int, delay_s: float
) -> None:
    python = python or ab.base_python(base)
    receipt.figures["base_sha"] = ab.checkout_sha(base)
    for name, delay, seed_files, rounds in turn_runs(files, delay_s, repeats):
        figures, _ = ab.compare(python, repeats=rounds, warmup=warmup, delay_s=delay, seed_files=seed_files)
        receipt.figures[name] = {
            key: figures[key]
            for kind in ab.KINDS
            for key in (f"end_to_end_{kind}", f"paired_diff_{kind}", f"first_byte_{kind}")
        }
        receipt.ratios[name] = {kind: figures[f"end_to_end_{kind}"]["ratio_p50"] for kind in ab.KINDS}
        parts = []
        for kind in ab.KINDS:
            diff, ends = figures[f"paired_diff_{kind}"], figures[f"end_to_end_{kind}"]
            parts.append(
                f"{kind}: {ends['subject']['p50_ms']} vs {ends['baseline']['p50_ms']} ms p50 "
                f"({diff['p50_difference_ms']:+} ms; paired median {diff['median_ms']:+} ms, "
                f"95% interval {diff['ci95_ms']})"
            )
        receipt.notes.append(
            f"{name} ({rounds} rounds; LM lines delayed {delay:g} s; the long session's workspace holds "
            f"{seed_files} files), this vs the code before versions: " + "; ".join(parts)
        )
    empty, full, _slow = (name for name, *_ in turn_runs(files, delay_s, repeats))
    receipt.goals.append(turn_goal("warm_turn", "an empty workspace", receipt.figures[empty]))
    receipt.goals.append(turn_goal("warm_turn_files", f"{files} files", receipt.figures[full]))


def turn_goal(name: str, workspace: str, figures: dict[str, Any] | None) -> dict[str, Any]:
    target = (
        f"a warm Turn (running conversation, nothing changed, {workspace}) p50 ≤ {GOAL_MS:g} ms over "
        "the code before versions"
    )
    if figures is None:
        note = "not measured: run the lane with --base <a checkout before versions> [--base-python]"
        return goal(name, target, None, None, note)
    same_session = figures["paired_diff_same_session"]
    measured = {key: same_session[key] for key in ("p50_difference_ms", "median_ms", "ci95_ms")}
    note = (
        "zero-delay scripted LM lines; p50_difference_ms is this p50 - base p50, median_ms the "
        "median of the rounds' paired differences, ci95_ms its distribution-free interval"
    )
    return goal(name, target, measured, same_session["p50_difference_ms"] <= GOAL_MS, note)
