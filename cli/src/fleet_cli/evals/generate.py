"""Datasets made here, by a seeded generator (never downloaded): the same seed gives the same
bytes, so a receipt's dataset hash names it.

- `niah`: needle in a haystack, in the spirit of S-NIAH: one fact ("the secret code for X is N")
  hidden at a random depth in filler text; haystacks spread from 100k to 1M characters.
- `oolong`: aggregation over a synthetic table, in the spirit of OOLONG: count or sum the rows
  of one label in a long list of records; every row must be read."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

WORDS = (
    "river", "stone", "lantern", "orchard", "copper", "meadow", "harbor", "violet",
    "signal", "timber", "ember", "glacier", "quarry", "saddle", "thistle", "beacon",
)  # fmt: skip
LABELS = ("alpha", "beta", "gamma", "delta")
KINDS = ("niah", "oolong")


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 14))).capitalize() + "."


def sizes(rows: int, smallest: int, largest: int) -> list[int]:
    """`rows` haystack sizes spread evenly (on a log scale) from `smallest` to `largest`."""
    if rows == 1:
        return [smallest]
    ratio = (largest / smallest) ** (1 / (rows - 1))
    return [round(smallest * ratio**i) for i in range(rows)]


def niah_row(rng: random.Random, index: int, chars: int) -> dict[str, Any]:
    name = f"{rng.choice(WORDS)}-{rng.randint(100, 999)}"
    code = str(rng.randint(100000, 999999))
    filler: list[str] = []
    size = 0
    while size < chars:
        filler.append(sentence(rng))
        size += len(filler[-1]) + 1
    filler.insert(rng.randrange(len(filler) + 1), f"The secret code for {name} is {code}.")
    question = f"What is the secret code for {name}? Reply with the number only."
    request = f"{question}\n\n<document>\n{' '.join(filler)}\n</document>"
    return {"id": f"niah-{index:03d}-{chars}", "request": request, "expected": code, "metric": "numeric"}


def oolong_row(rng: random.Random, index: int, chars: int) -> dict[str, Any]:
    target = rng.choice(LABELS)
    summing = index % 2 == 1
    lines: list[str] = []
    count = total = size = 0
    while size < chars:
        label, amount = rng.choice(LABELS), rng.randint(1, 500)
        if label == target:
            count, total = count + 1, total + amount
        lines.append(f"{len(lines) + 1} | user{rng.randint(1, 9999)} | {label} | {amount}")
        size += len(lines[-1]) + 1
    if summing:
        question = f"What is the total amount of the records labelled {target}? Reply with the number only."
    else:
        question = f"How many records are labelled {target}? Reply with the number only."
    table = "\n".join(["id | user | label | amount", *lines])
    return {
        "id": f"oolong-{index:03d}-{chars}",
        "request": f"{question}\n\n<records>\n{table}\n</records>",
        "expected": total if summing else count,
        "metric": "numeric",
    }


def generate(
    kind: str, rows: int, seed: int, smallest: int = 100_000, largest: int = 1_000_000
) -> Iterator[dict[str, Any]]:
    rng = random.Random(f"{kind}:{seed}")
    make = niah_row if kind == "niah" else oolong_row
    for index, chars in enumerate(sizes(rows, smallest, largest)):
        yield make(rng, index, chars)


def write_dataset(
    path: Path, kind: str, rows: int, seed: int, *, smallest: int = 100_000, largest: int = 1_000_000
) -> Path:
    if kind not in KINDS:
        raise ValueError(f"unknown dataset {kind!r}: one of {', '.join(KINDS)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for row in generate(kind, rows, seed, smallest, largest):
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path
