"""`python -m bench [lane ...] [--quick]` runs lanes and writes their receipts;
`python -m bench report` renders the latest receipt of each lane (Markdown, and a PNG plot when
matplotlib imports)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import density, fanout, first_token, live, recovery, sandbox, scale, soak, turn, workspace
from bench.report import goals_table, write_report

LANES: dict[str, Callable[..., dict[str, Any]]] = {
    "turn": turn.run,
    "sandbox": sandbox.run,
    "fanout": fanout.run,
    "scale": scale.run,
    "recovery": recovery.run,
    "soak": soak.run,
    "workspace": workspace.run,
    "live": live.run,
    "first-token": first_token.run,
    "density": density.run,
}
ORDER = [
    "turn", "sandbox", "fanout", "scale", "recovery", "soak", "workspace", "first-token", "density", "live",
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench", description=__doc__)
    parser.add_argument("lanes", nargs="*", default=ORDER, help=f"lanes to run, or `report`: {ORDER}")
    parser.add_argument("--quick", action="store_true", help="few samples, small N (a smoke run)")
    parser.add_argument("--streams", help="fanout: comma-separated stream counts, e.g. 100,2000")
    parser.add_argument("--turns", type=int, help="soak: how many Turns")
    parser.add_argument("--base", type=Path, help="workspace: a checkout before versions (the Turn goal)")
    parser.add_argument("--base-python", help="workspace: that checkout's interpreter (default: its .venv's)")
    parser.add_argument(
        "--dataset", choices=("niah", "oolong"), help="live: one generated dataset (default: both)"
    )
    parser.add_argument("--rows", type=int, help="live: rows per dataset (default: 10, --quick 2)")
    args = parser.parse_args(argv)
    if args.lanes == ["report"]:
        markdown, written = write_report()
        print(markdown)
        for path in written:
            print(f"wrote {path}", file=sys.stderr)
        return 0
    unknown = [lane for lane in args.lanes if lane not in LANES]
    if unknown:
        parser.error(f"unknown lane(s) {unknown}; known: {ORDER} or `report`")
    failed = []
    for lane in args.lanes:
        kwargs: dict[str, Any] = {"quick": args.quick}
        if lane == "fanout" and args.streams:
            kwargs["streams"] = tuple(int(n) for n in args.streams.split(","))
        if lane == "soak" and args.turns:
            kwargs["turns"] = args.turns
        if lane == "live":
            kwargs.update(dataset=args.dataset, rows=args.rows)
        if lane == "workspace" and args.base:
            kwargs.update(base=args.base.resolve(), base_python=args.base_python)
        print(f"== lane {lane}{' (quick)' if args.quick else ''}", file=sys.stderr, flush=True)
        try:
            receipt = LANES[lane](**kwargs)
        except Exception as exc:  # one broken lane must not hide the others' receipts
            failed.append(lane)
            print(f"lane {lane} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        print(goals_table(receipt))
    if len(args.lanes) > 1 and not failed:
        markdown, written = write_report()
        for path in written:
            print(f"wrote {path}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
