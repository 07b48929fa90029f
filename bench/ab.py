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


def run(base: Path, *, repeats: int = 60, warmup: int = 5) -> dict[str, Any]:
    python = base_python(base)
    receipt = Receipt(
        "ab",
        {"base": str(base), "repeats": repeats, "warmup": warmup, "workers": 1,
         "script": "plain cell, llm_query, SUBMIT; delay 0"},
        baseline=f"the fleet of {base} (its git sha in figures.base_sha), in a stack beside this one",
    )  # fmt: skip
    first_bytes: dict[str, list[float]] = {}
    timings: dict[str, list[float]] = {}
    with (
        fleet_stack.stack(script=SCRIPT) as this,
        fleet_stack.stack(script=SCRIPT, python=python) as other,
    ):
        this.start(workers=1)
        other.start(workers=1)
        this.wait_workers_ready(1)
        other.wait_workers_ready(1)
        sides = {"this": this, "base": other}
        conversations = {name: fleet_stack.new_session(st.url) for name, st in sides.items()}

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
    receipt.figures = {"base_sha": checkout_sha(base)}
    for kind in KINDS:
        mine, theirs = (first_bytes[f"{side}.{kind}"][warmup:] for side in sides)
        receipt.figures[f"first_byte_{kind}"] = compared(mine, theirs)
        receipt.figures[f"end_to_end_{kind}"] = compared(samples[f"this.{kind}"], samples[f"base.{kind}"])
        receipt.ratios[f"first_byte_{kind}_p50"] = receipt.figures[f"first_byte_{kind}"]["ratio_p50"]
        receipt.ratios[f"end_to_end_{kind}_p50"] = receipt.figures[f"end_to_end_{kind}"]["ratio_p50"]
    receipt.figures["server_timing"] = {
        name: summary(seconds[warmup * len(KINDS) :]) for name, seconds in sorted(timings.items())
    }
    receipt.notes.append(
        "subject: this checkout; baseline: the other. Each sample is one Turn posted on a raw "
        "socket; first byte is the response's first byte, end to end is `data: [DONE]`"
    )
    return receipt.written()


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
    args = parser.parse_args(argv)
    receipt = run(args.base.resolve(), repeats=args.repeats, warmup=args.warmup)
    print(json.dumps(receipt, indent=2, ensure_ascii=False))
    print(f"receipt: {receipt.get('receipt_path')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
