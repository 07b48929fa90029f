"""A Daytona sandbox's workspace seen from the host, through the SDK's file API.

The files live in the remote sandbox, so no host path is ever involved; what comes back is still
hostile: links are skipped, sizes are checked before and while copying, names stay relative.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from fleet_shared.confined import MAX_DEPTH, parts_of
from fleet_worker.sandbox.provider import FileStamp, Writable

DOWNLOAD_TIMEOUT_SECONDS = 300


def is_link(info: Any) -> bool:
    mode = str(getattr(info, "mode", ""))
    return mode.startswith(("L", "l")) or "symlink" in mode.lower()


def mtime_ns(info: Any) -> int:
    stamp = getattr(info, "modified_at", None) or ""
    try:
        return int(datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1e9)
    except ValueError:
        return hash(str(getattr(info, "mod_time", "")))


class DaytonaWorkspaceFiles:
    def __init__(self, sandbox: Any, root: str) -> None:
        self.sandbox = sandbox
        self.root = root.rstrip("/")

    def path(self, relative: str) -> str:
        return "/".join([self.root, *parts_of(relative)])

    def put(self, relative: str, source: Path) -> None:
        self.sandbox.fs.upload_file(str(source), self.path(relative))

    def stamps(self, folder: str, limit: int) -> dict[str, FileStamp]:
        found: dict[str, FileStamp] = {}
        pending: list[tuple[str, int]] = [("", 0)]
        base = self.path(folder)
        while pending and len(found) < limit:
            prefix, depth = pending.pop()
            try:
                entries = self.sandbox.fs.list_files(f"{base}/{prefix}".rstrip("/"))
            except Exception:
                continue
            for info in entries:
                name = str(info.name)
                if "/" in name or name in (".", "..") or is_link(info):
                    continue
                relative = f"{prefix}{name}"
                if info.is_dir:
                    if depth < MAX_DEPTH:
                        pending.append((f"{relative}/", depth + 1))
                    continue
                found[relative] = FileStamp(int(info.size), mtime_ns(info))
                if len(found) >= limit:
                    break
        return found

    def export(self, relative: str, sink: Writable, max_bytes: int) -> int:
        remote = self.path(relative)
        info = self.sandbox.fs.get_file_info(remote)
        if info.is_dir or is_link(info):
            raise FileNotFoundError(relative)
        if int(info.size) > max_bytes:
            raise ValueError(f"{relative} is {info.size} bytes, more than {max_bytes}")
        total = 0
        stream = self.sandbox.fs.download_file_stream(remote, timeout=DOWNLOAD_TIMEOUT_SECONDS)
        try:
            for chunk in stream:
                total += len(chunk)
                if total > max_bytes:  # it grew (or was swapped) between the look and the copy
                    raise ValueError(f"{relative} is more than {max_bytes} bytes")
                sink.write(chunk)
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()  # stop the transfer: nothing past the cap is read
        return total
