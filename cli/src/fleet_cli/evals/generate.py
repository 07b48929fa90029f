"""Datasets made here, by a seeded generator (never downloaded): the same seed gives the same
bytes, so a receipt's dataset hash names them.

- `niah`: needle in a haystack, in the spirit of S-NIAH: one fact ("the secret code for X is N")
  hidden at a random depth in filler text; haystacks spread from 100k to 1M characters.
- `oolong`: aggregation over a synthetic table, in the spirit of OOLONG: count or sum the rows
  of one label in a long list of records; every row must be read.

The long input of each row is an attachment beside the dataset (a Turn's text is bounded by
`gateway.limits.max_text_chars`); the request is the question, naming the file."""

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
MIN_CHARS = 1_000


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 14))).capitalize() + "."


def sizes(rows: int, smallest: int, largest: int) -> list[int]:
    """`rows` input sizes spread evenly (on a log scale) from `smallest` to `largest`."""
    if rows == 1:
        return [smallest]
    ratio = (largest / smallest) ** (1 / (rows - 1))
    return [round(smallest * ratio**i) for i in range(rows)]


def niah_row(rng: random.Random, name: str, chars: int) -> tuple[dict[str, Any], str]:
    key = f"{rng.choice(WORDS)}-{rng.randint(100, 999)}"
    code = str(rng.randint(100000, 999999))
    filler: list[str] = []
    size = 0
    while size < chars:
        filler.append(sentence(rng))
        size += len(filler[-1]) + 1
    filler.insert(rng.randrange(len(filler) + 1), f"The secret code for {key} is {code}.")
    question = f"What is the secret code for {key}? It is in the attached {name}. Reply with the number only."
    return {"request": question, "expected": code}, " ".join(filler) + "\n"


def oolong_row(rng: random.Random, name: str, chars: int, *, summing: bool) -> tuple[dict[str, Any], str]:
    target = rng.choice(LABELS)
    lines = ["id | user | label | amount"]
    count = total = 0
    size = len(lines[0])
    while size < chars:
        label, amount = rng.choice(LABELS), rng.randint(1, 500)
        if label == target:
            count, total = count + 1, total + amount
        lines.append(f"{len(lines)} | user{rng.randint(1, 9999)} | {label} | {amount}")
        size += len(lines[-1]) + 1
    ask = f"what is the total amount of the records labelled {target}" if summing else ""
    ask = ask or f"how many records are labelled {target}"
    question = f"In the attached table {name}, {ask}? Reply with the number only."
    return {"request": question, "expected": total if summing else count}, "\n".join(lines) + "\n"


def generate(
    kind: str, rows: int, seed: int, smallest: int = 100_000, largest: int = 1_000_000
) -> Iterator[tuple[dict[str, Any], str]]:
    """Each row (its attachment named in `attachments`) with that attachment's text."""
    if kind not in KINDS:
        raise ValueError(f"unknown dataset {kind!r}: one of {', '.join(KINDS)}")
    rng = random.Random(f"{kind}:{seed}")
    for index, chars in enumerate(sizes(rows, max(MIN_CHARS, smallest), max(MIN_CHARS, largest))):
        row_id = f"{kind}-{index:03d}-{chars}"
        name = f"{row_id}.txt"
        if kind == "niah":
            row, text = niah_row(rng, name, chars)
        else:
            row, text = oolong_row(rng, name, chars, summing=index % 2 == 1)
        yield {"id": row_id, **row, "attachments": [name], "metric": "numeric"}, text


def write_dataset(
    path: Path, kind: str, rows: int, seed: int, *, smallest: int = 100_000, largest: int = 1_000_000
) -> Path:
    """The dataset at `path`, each row's attachment beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for row, text in generate(kind, rows, seed, smallest, largest):
            (path.parent / row["attachments"][0]).write_text(text, encoding="utf-8")
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path
