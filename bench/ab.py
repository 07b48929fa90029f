"""`python -m bench.ab --base DIR`: this checkout against another one, in the same run.

A before/after pair of `turn` receipts taken minutes apart on this machine can differ by 30% for
no reason of the code's (the `turn` floor moved from 55 to 73 ms between two runs of one
afternoon). So an optimisation's evidence compares both versions side by side: two private
stacks, one running this checkout's fleet and one running the fleet of `DIR` (another checkout,
with its own `uv sync`ed `.venv`), and Turns posted to them alternately, each kind of Turn
(a new session's first, one more in a long session) in turn (see `paired_order`).

The receipt (lane `ab`) has, for each kind, the first byte and POST → `[DONE]` of both sides, the
ratio this / base, and the gateway's Server-Timing account (claim, enqueue) of both. Settings
that are the host's, not the checkout's (the sandboxes' cgroup weight, which the last worker to
start writes), are the same for both sides.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import stack as fleet_stack
from bench.harness import Receipt, compared, summary
from bench.turn import SCRIPT, parse_server_timing

KINDS = ("new_session", "same_session")


def paired_order(index: int) -> list[tuple[str, str]]:
    """Round `index`: each kind of Turn on both sides, which side first alternating by round.
    Never the same side's same kind twice in a row: a Turn posted the moment the last one in
    its session ended finds that session's next REPL still starting (the `turn` lane never does
    that either), which made the side that did so look ~15% slower in a run of a checkout
    against itself."""
    sides = ("this", "base") if index % 2 == 0 else ("base", "this")
    return [(side, kind) for kind in KINDS for side in sides]


def base_python(checkout: Path) -> str:
    python = checkout / ".venv" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{checkout} has no .venv: run `uv sync --locked` there first")
    return str(python)


def run(
    base: Path,
    *,
    repeats: int = 60,
    warmup: int = 5,
    delay_s: float = 0.0,
    python: str | None = None,
    seed_files: int = 0,
) -> dict[str, Any]:
    """`python`: the other checkout's interpreter, by default its own `.venv`'s."""
    python = python or base_python(base)
    receipt = Receipt(
        "ab",
        {"base": str(base), "base_python": python, "repeats": repeats, "warmup": warmup, "workers": 1,
         "script": f"plain cell, llm_query, SUBMIT; delay {delay_s}", "seed_files": seed_files},
        baseline=f"the fleet of {base} (its git sha in figures.base_sha), in a stack beside this one",
    )  # fmt: skip
    receipt.figures, receipt.ratios = compare(
        python, repeats=repeats, warmup=warmup, delay_s=delay_s, seed_files=seed_files
    )
    receipt.figures["base_sha"] = checkout_sha(base)
    receipt.notes.append(
        "subject: this checkout; baseline: the other. Each sample is one Turn posted on a raw "
        "socket; first byte is the response's first byte, end to end is `data: [DONE]`"
    )
    return receipt.written()


SEED_REQUEST = "seed"


def seeding_script(files: int, delay_s: float = 0.0) -> str:
    """The lanes' Turn, whose first cell, for the request `seed` only, writes `files` notes of
    2 KiB into the workspace (under memory/notes/, a hundred to a folder)."""
    seed = (
        f"if request == {SEED_REQUEST!r}:\n"
        "    import os, pathlib\n"
        f"    for i in range({files}):\n"
        "        p = pathlib.Path(f'/workspace/memory/notes/d{i // 100:02d}/n{i:04d}.md')\n"
        "        p.parent.mkdir(parents=True, exist_ok=True)\n"
        "        p.write_bytes(os.urandom(2048))\n"
    )
    lines = fleet_stack.three_step_script(delay_s).splitlines(keepends=True)
    first = json.loads(lines[0])
    first["code"] = seed + first["code"]
    return json.dumps(first) + "\n" + "".join(lines[1:])


def compare(
    python: str, *, repeats: int, warmup: int, delay_s: float = 0.0, seed_files: int = 0
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Figures and ratios of this checkout's stack against one run by `python` (another
    checkout's interpreter), Turns posted to both alternately. `delay_s` delays every scripted
    LM line, as a provider's latency would. With `seed_files`, each side's long session first
    runs one untimed Turn that writes that many files to its workspace (which its later Turns
    leave unchanged). Each kind's `paired_diff_<kind>` is this - base taken round by round (the
    two Turns of a round ran back to back), with its median's 95% interval."""
    if seed_files:
        script = seeding_script(seed_files, delay_s)
    else:
        script = fleet_stack.three_step_script(delay_s) if delay_s else SCRIPT
    first_bytes: dict[str, list[float]] = {}
    timings: dict[str, list[float]] = {}
    with (
        fleet_stack.stack(script=script) as this,
        fleet_stack.stack(script=script, python=python) as other,
    ):
        this.start(workers=1)
        other.start(workers=1)
        this.wait_workers_ready(1)
        other.wait_workers_ready(1)
        sides = {"this": this, "base": other}
        conversations = {name: fleet_stack.new_session(st.url) for name, st in sides.items()}
        if seed_files:
            for name, st in sides.items():
                seeded = fleet_stack.post_turn(st.port, conversations[name], SEED_REQUEST)
                if not seeded.finished:
                    raise RuntimeError(f"the seeding Turn on {name} did not finish: {seeded.raw[-600:]!r}")

        def turn(side: str, kind: str) -> Callable[[], float]:
            st = sides[side]

            def one() -> float:
                session = fleet_stack.new_session(st.url) if kind == "new_session" else conversations[side]
                result = fleet_stack.post_turn(st.port, session)
                if not result.finished:
                    raise RuntimeError(f"a Turn on {side} did not finish: {result.raw[-600:]!r}\n{st.logs()}")
                first_bytes.setdefault(f"{side}.{kind}", []).append(result.first_byte_s)
                for name, seconds in parse_server_timing(fleet_stack.header(result.raw, "server-timing")):
                    timings.setdefault(f"{side}.{name}", []).append(seconds)
                return result.end_s

            return one

        samples: dict[str, list[float]] = {f"{side}.{kind}": [] for kind in KINDS for side in sides}
        for index in range(warmup + repeats):
            for side, kind in paired_order(index):
                seconds = turn(side, kind)()
                if index >= warmup:
                    samples[f"{side}.{kind}"].append(seconds)
    figures: dict[str, Any] = {}
    found_ratios: dict[str, Any] = {}
    for kind in KINDS:
        mine, theirs = (first_bytes[f"{side}.{kind}"][warmup:] for side in sides)
        figures[f"first_byte_{kind}"] = compared(mine, theirs)
        figures[f"end_to_end_{kind}"] = compared(samples[f"this.{kind}"], samples[f"base.{kind}"])
        figures[f"paired_diff_{kind}"] = paired_difference(samples[f"this.{kind}"], samples[f"base.{kind}"])
        found_ratios[f"first_byte_{kind}_p50"] = figures[f"first_byte_{kind}"]["ratio_p50"]
        found_ratios[f"end_to_end_{kind}_p50"] = figures[f"end_to_end_{kind}"]["ratio_p50"]
    figures["server_timing"] = {
        name: summary(seconds[warmup * len(KINDS) :]) for name, seconds in sorted(timings.items())
    }
    return figures, found_ratios


def paired_difference(subject_s: list[float], baseline_s: list[float]) -> dict[str, Any]:
    """this - base, sample by sample (both lists in round order), in ms: the median and a
    distribution-free 95% interval for it (order statistics of the differences; the sign test's),
    and the difference of the two sides' p50s. A round's two Turns met the same moment of the
    machine's noise, so their difference is steadier than two p50s taken apart."""
    diffs = sorted((mine - theirs) * 1000 for mine, theirs in zip(subject_s, baseline_s, strict=True))
    n = len(diffs)
    if n == 0:
        return {"n": 0}
    low, high = median_interval(n)
    mid = (diffs[(n - 1) // 2] + diffs[n // 2]) / 2
    mine, theirs = summary(subject_s), summary(baseline_s)
    return {
        "n": n,
        "median_ms": round(mid, 3),
        "ci95_ms": [round(diffs[low], 3), round(diffs[high], 3)] if low is not None else None,
        "p50_difference_ms": round(mine["p50_ms"] - theirs["p50_ms"], 3),
    }


def median_interval(n: int, confidence: float = 0.95) -> tuple[int | None, int]:
    """Indices (0-based, into n sorted samples) of a distribution-free interval for the median:
    the widest k with P(Binomial(n, ½) < k) ≤ (1 - confidence)/2 gives (k - 1, n - k). None when
    n is too small for any such interval."""
    tail = (1 - confidence) / 2
    below, k = 0.0, 0
    while k < n and below + math.comb(n, k) / 2**n <= tail:
        below += math.comb(n, k) / 2**n
        k += 1
    if k == 0:
        return None, n - 1
    return k - 1, n - k


def checkout_sha(checkout: Path) -> str | None:
    done = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True, check=False
    )
    return done.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the other checkout (with a .venv)")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before each scripted LM line")
    parser.add_argument("--base-python", help="the other checkout's interpreter (default: its .venv's)")
    parser.add_argument("--seed-files", type=int, default=0, help="files the long session's workspace holds")
    args = parser.parse_args(argv)
    receipt = run(
        args.base.resolve(), repeats=args.repeats, warmup=args.warmup, delay_s=args.delay,
        python=args.base_python, seed_files=args.seed_files,
    )  # fmt: skip
    print(json.dumps(receipt, indent=2, ensure_ascii=False))
    print(f"receipt: {receipt.get('receipt_path')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
