"""A Daytona sandbox's workspace seen from the host, through the SDK's file API.

The files live in the remote sandbox, so no host path is ever involved; what comes back is still
hostile: links are skipped, sizes are checked before and while copying, names stay relative.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fleet_shared.confined import parts_of
from fleet_worker.sandbox.daytona.listing import kind_of, walk
from fleet_worker.sandbox.provider import FileStamp, Writable
from fleet_worker.workspace_objects import COPY_CHUNK

DOWNLOAD_TIMEOUT_SECONDS = 300


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
        if limit <= 0:
            return found
        for listed in walk(self.sandbox, self.path(folder), strict=False):
            if listed.kind == "file":
                stamp = listed.stamp if listed.stamp is not None else -1  # unreadable: as unchanged
                found[listed.relative] = FileStamp(listed.size, stamp)
                if len(found) >= limit:
                    break
        return found

    def export(self, relative: str, sink: Writable, max_bytes: int) -> int:
        info = self.sandbox.fs.get_file_info(self.path(relative))
        if kind_of(info) != "file":
            raise FileNotFoundError(relative)
        if int(info.size) > max_bytes:
            raise ValueError(f"{relative} is {info.size} bytes, more than {max_bytes}")
        total = 0
        with RemoteReader(self.sandbox, self.path(relative), int(info.size), max_bytes) as reader:
            while chunk := reader.read(COPY_CHUNK):
                total += len(chunk)
                sink.write(chunk)
        return total


class RemoteReader:
    """A sandbox file, downloaded as a stream and read like a local one, never past `max_bytes`
    (ValueError: it grew, or was swapped, between the look and the copy). A file listed empty
    is not downloaded: the SDK's stream takes a file with no data for a failed download."""

    def __init__(self, sandbox: Any, remote: str, listed_size: int, max_bytes: int) -> None:
        self.remote = remote
        self.max_bytes = max_bytes
        self.total = 0
        self._chunks: Iterator[bytes] = iter(())
        self._stream: Any = None
        self._held = b""
        if listed_size > 0:
            self._stream = sandbox.fs.download_file_stream(remote, timeout=DOWNLOAD_TIMEOUT_SECONDS)
            self._chunks = iter(self._stream)

    def read(self, size: int = -1) -> bytes:
        while not self._held:
            chunk = next(self._chunks, None)
            if chunk is None:
                return b""
            self.total += len(chunk)
            if self.total > self.max_bytes:
                raise ValueError(f"{self.remote} is more than {self.max_bytes} bytes")
            self._held = chunk
        cut = len(self._held) if size < 0 else size
        data, self._held = self._held[:cut], self._held[cut:]
        return data

    def __enter__(self) -> RemoteReader:
        return self

    def __exit__(self, *_exc: object) -> None:
        close = getattr(self._stream, "close", None)
        if close is not None:
            close()  # stop the transfer: nothing past the cap is read
