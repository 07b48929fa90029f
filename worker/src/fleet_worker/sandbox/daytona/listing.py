"""A Daytona sandbox's folders as the SDK's file API lists them, read as hostile input.

The daemon answers one folder per request, each entry with a name, a size, a Go `FileMode`
string (`-rw-r--r--` for a regular file, `d…` a folder, `L…` a link, `D…`/`p…`/`S…` devices,
pipes and sockets), its permission bits and its modification time. Names that are not one plain
path component are dropped; links are never entered; folders nested past MAX_DEPTH are not
walked. What a walk yields is what the caller decides to trust: sizes and times are only ever
compared with what fleet itself recorded, never used to reach outside `/workspace`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from daytona import DaytonaError, DaytonaNotFoundError

from fleet_shared.confined import MAX_DEPTH

Kind = Literal["file", "dir", "other"]
SPECIAL_TYPE_LETTERS = frozenset("ugt")  # setuid, setgid, sticky: still a regular file
# RFC 3339 with up to nine fraction digits (the daemon's `modifiedAt`), or Go's time.String()
# layout (its older `modTime`): "2006-01-02 15:04:05.999999999 -0700 MST".
STAMP = re.compile(
    r"(\d{4}-\d\d-\d\d)[T ](\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?\s*(Z|[+-]\d\d:?\d\d)(?:\s|$)", re.IGNORECASE
)


@dataclass(frozen=True)
class Listed:
    """One entry under the walked folder: its path relative to that folder, what it is, and
    what the daemon says of it (`stamp` is None when its time cannot be read exactly)."""

    relative: str
    kind: Kind
    size: int
    mode: int
    stamp: int | None


def stamp_ns(text: str) -> int | None:
    """A listed time as integer nanoseconds since the epoch, exactly as the daemon gave it."""
    found = STAMP.match(text.strip())
    if found is None:
        return None
    day, clock, fraction, zone = found.groups()
    zone = "+00:00" if zone.upper() == "Z" else zone if ":" in zone else f"{zone[:3]}:{zone[3:]}"
    try:
        seconds = int(datetime.fromisoformat(f"{day}T{clock}{zone}").timestamp())
    except ValueError:
        return None
    return seconds * 1_000_000_000 + int((fraction or "").ljust(9, "0"))


def modified_ns(info: Any) -> int | None:
    for field in ("modified_at", "mod_time"):
        value = getattr(info, field, None)
        if isinstance(value, str) and (stamp := stamp_ns(value)) is not None:
            return stamp
    return None


def kind_of(info: Any) -> Kind:
    mode = str(getattr(info, "mode", ""))
    type_letters = mode[: max(len(mode) - 9, 0)]
    if "symlink" in mode.lower() or "L" in type_letters:
        return "other"
    if info.is_dir:
        return "dir" if type_letters.startswith("d") else "other"
    if type_letters == "-" or (type_letters and set(type_letters) <= SPECIAL_TYPE_LETTERS):
        return "file"
    return "other"


def permission_bits(info: Any) -> int:
    try:
        return int(str(getattr(info, "permissions", "")), 8) & 0o777
    except ValueError:
        return 0o644


def plain_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\x00" not in name


def walk(
    sandbox: Any,
    base: str,
    *,
    strict: bool = True,
    descend: Callable[[str], bool] = lambda _relative: True,
) -> Iterator[Listed]:
    """Every entry under `base`, folder by folder, entering only folders `descend` allows. A
    folder that vanished is skipped; any other refusal raises (with `strict`: a walk that
    silently skipped a folder would make a version lose its files) or is skipped."""
    pending: list[tuple[str, int]] = [("", 0)]
    while pending:
        prefix, depth = pending.pop()
        try:
            infos = sandbox.fs.list_files(f"{base}/{prefix}".rstrip("/"))
        except DaytonaNotFoundError:
            continue
        except DaytonaError:
            if strict:
                raise
            continue
        for info in infos:
            name = str(info.name)
            if not plain_name(name):
                continue
            relative = f"{prefix}{name}"
            listed = Listed(relative, kind_of(info), int(info.size), permission_bits(info), modified_ns(info))
            yield listed
            if listed.kind == "dir" and depth < MAX_DEPTH and descend(relative):
                pending.append((f"{relative}/", depth + 1))
