"""`python -m bench [lane ...]`: run benchmark lanes and write their receipts."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench import sandbox

LANES = {"sandbox": sandbox.run}
RECEIPTS = Path(__file__).resolve().parent / "receipts"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench")
    parser.add_argument("lanes", nargs="*", default=sorted(LANES), help=f"lanes to run: {sorted(LANES)}")
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    args = parser.parse_args(argv)
    unknown = [lane for lane in args.lanes if lane not in LANES]
    if unknown:
        parser.error(f"unknown lane(s) {unknown}; known: {sorted(LANES)}")
    RECEIPTS.mkdir(exist_ok=True)
    for lane in args.lanes:
        receipt = LANES[lane](quick=args.quick)
        receipt = {"lane": lane, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **receipt}
        path = RECEIPTS / f"{lane}-{time.strftime('%Y%m%dT%H%M%S')}.json"
        path.write_text(json.dumps(receipt, indent=2) + "\n")
        print(json.dumps(receipt, indent=2))
        print(f"receipt: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
