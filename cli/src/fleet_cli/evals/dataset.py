"""A dataset: JSONL, one row per line, `{id, request, attachments?, expected?, metric?}`.

Every row is checked before any Turn is sent: a malformed line, a duplicate id, an unknown
metric or a missing attachment stops the run with the line that is wrong."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

BUILT_IN_METRICS = ("exact", "contains", "regex", "numeric", "judge")
# A Python hook: `package.module:function`.
HOOK_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*\Z"
MetricName = Annotated[str, msgspec.Meta(pattern=rf"^(exact|contains|regex|numeric|judge)\Z|{HOOK_PATTERN}")]


class Metric(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a row's answer is scored; a bare name in the row is this with its defaults."""

    name: MetricName
    tolerance: Annotated[float, msgspec.Meta(ge=0)] = 0.0  # numeric: |answer - expected| allowed
    pattern: str | None = None  # regex: searched for in the answer (default: `expected`)
    rubric: str | None = None  # judge: what a good answer does (default: matches `expected`)


class Row(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    request: Annotated[str, msgspec.Meta(min_length=1)]
    attachments: tuple[str, ...] = ()  # files, relative to the dataset's folder
    expected: str | int | float | None = None
    metric: MetricName | Metric | None = None


@dataclass(frozen=True)
class Dataset:
    path: Path
    rows: tuple[Row, ...]
    sha256: str  # of the file's bytes: the receipt names exactly what was run

    def attachment(self, name: str) -> Path:
        return (self.path.parent / name).resolve()


class DatasetError(ValueError):
    """The dataset cannot be run; the message names the line."""


def metric_of(row: Row, default: Metric) -> Metric:
    if row.metric is None:
        return default
    return Metric(name=row.metric) if isinstance(row.metric, str) else row.metric


def load_dataset(path: Path, limit: int | None = None) -> Dataset:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"{path}: {exc.strerror}") from exc
    rows: list[Row] = []
    seen: set[str] = set()
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = msgspec.json.decode(line, type=Row)
        except msgspec.ValidationError as exc:
            raise DatasetError(f"{path}:{number}: {exc}") from exc
        except msgspec.DecodeError as exc:
            raise DatasetError(f"{path}:{number}: not a JSON object ({exc})") from exc
        if row.id in seen:
            raise DatasetError(f"{path}:{number}: the id {row.id!r} is used twice")
        seen.add(row.id)
        for name in row.attachments:
            if not (path.parent / name).resolve().is_relative_to(path.parent.resolve()):
                raise DatasetError(
                    f"{path}:{number}: the attachment {name!r} is outside the dataset's folder"
                )
            if not (path.parent / name).is_file():
                raise DatasetError(
                    f"{path}:{number}: the attachment {name!r} is not a file next to the dataset"
                )
        rows.append(row)
    if not rows:
        raise DatasetError(f"{path}: no rows")
    for row in rows:  # a pattern that cannot compile fails here, not after its Turn
        if isinstance(row.metric, Metric) and row.metric.pattern is not None:
            try:
                re.compile(row.metric.pattern)
            except re.error as exc:
                raise DatasetError(f"{path}: row {row.id!r}: the pattern is not a regex ({exc})") from exc
    chosen = rows[:limit] if limit else rows
    return Dataset(path=path.resolve(), rows=tuple(chosen), sha256=hashlib.sha256(data).hexdigest())
