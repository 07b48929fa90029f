"""The toolbox file API of the fake Daytona (tests/support/fake_daytona.py), as the daemon
answers it: listings with Go `FileMode` strings, permission bits and times in RFC 3339 with
nanoseconds; an upload replaces the file (mode 0644), never writing through a link; a missing
file comes back as an error part of the download. Every file sent or fetched is recorded."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from aiohttp import MultipartWriter, web


class Mapped(Protocol):
    def local(self, path: str) -> Path: ...


class FakeFiles:
    def __init__(self) -> None:
        self.swapped_on_download: dict[str, bytes] = {}  # a file a sandbox swaps after its stat
        self.uploaded: list[str] = []  # sandbox paths, in the order they were written
        self.downloaded: list[str] = []

    def find(self, request: web.Request, key: str = "id") -> Mapped:
        raise NotImplementedError

    async def upload(self, request: web.Request) -> web.Response:
        sandbox = self.find(request, "sandbox")
        reader = await request.multipart()
        paths: dict[str, str] = {}
        contents: dict[str, bytes] = {}
        async for part in reader:
            name = part.name or ""
            index = name.split("[", 1)[1].split("]", 1)[0] if "[" in name else "0"
            if name.endswith(".path"):
                paths[index] = (await part.read()).decode()  # type: ignore[union-attr]
            else:
                contents[index] = bytes(await part.read())  # type: ignore[union-attr]
        for index, path in paths.items():
            target = sandbox.local(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(dir=target.parent, prefix=".daytona-upload-")
            with os.fdopen(fd, "wb") as handle:
                handle.write(contents[index])
            os.chmod(temp, 0o644)
            os.replace(temp, target)
            self.uploaded.append(path)
        return web.json_response({})

    async def create_folder(self, request: web.Request) -> web.Response:
        self.find(request, "sandbox").local(request.query["path"]).mkdir(parents=True, exist_ok=True)
        return web.json_response({}, status=201)

    def info(self, path: Path) -> dict[str, Any]:
        info = path.lstat()
        seconds, nanos = divmod(info.st_mtime_ns, 1_000_000_000)
        fraction = f".{nanos:09d}".rstrip("0") if nanos else ""
        stamp = datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S") + fraction + "Z"
        return {
            "name": path.name,
            "isDir": stat.S_ISDIR(info.st_mode),
            "size": info.st_size,
            "modTime": str(info.st_mtime),
            "modifiedAt": stamp,
            "mode": go_file_mode(info.st_mode),
            "permissions": f"{stat.S_IMODE(info.st_mode) & 0o777:04o}",
            "owner": "daytona",
            "group": "daytona",
        }

    async def file_info(self, request: web.Request) -> web.Response:
        path = self.find(request, "sandbox").local(request.query["path"])
        if not path.exists() and not path.is_symlink():
            return web.json_response({"message": "file not found", "statusCode": 404}, status=404)
        return web.json_response(self.info(path))

    async def list_files(self, request: web.Request) -> web.Response:
        path = self.find(request, "sandbox").local(request.query["path"])
        if not path.is_dir():
            return web.json_response({"message": "not a directory", "statusCode": 404}, status=404)
        return web.json_response([self.info(child) for child in sorted(path.iterdir())])

    async def delete_file(self, request: web.Request) -> web.Response:
        path = self.find(request, "sandbox").local(request.query["path"])
        if not path.exists() and not path.is_symlink():
            return web.json_response({"message": "file not found", "statusCode": 404}, status=404)
        if path.is_dir() and not path.is_symlink():
            if request.query.get("recursive") == "true":
                shutil.rmtree(path)
            else:
                path.rmdir()
        else:
            path.unlink()
        return web.json_response({})

    async def set_permissions(self, request: web.Request) -> web.Response:
        path = self.find(request, "sandbox").local(request.query["path"])
        if "mode" in request.query:
            os.chmod(path, int(request.query["mode"], 8))
        return web.json_response({})

    async def download(self, request: web.Request) -> web.StreamResponse:
        sandbox = self.find(request, "sandbox")
        writer = MultipartWriter("form-data")
        for remote in (await request.json())["paths"]:
            data = self.swapped_on_download.pop(remote, None)
            local = sandbox.local(remote)
            if data is None and not local.is_file():
                error = {"message": "file not found", "statusCode": 404, "code": "FILE_NOT_FOUND"}
                part = writer.append_json(error)
                part.set_content_disposition("form-data", quote_fields=False, name="error", filename=remote)
                continue
            self.downloaded.append(remote)
            part = writer.append(local.read_bytes() if data is None else data)
            part.set_content_disposition("form-data", quote_fields=False, name="file", filename=remote)
        response = web.StreamResponse(
            headers={"Content-Type": f"multipart/form-data; boundary={writer.boundary}"}
        )
        await response.prepare(request)
        await writer.write(response)
        await response.write_eof()
        return response


def go_file_mode(mode: int) -> str:
    """A mode as Go's FileMode.String() writes it: type letters (or "-"), then the rwx bits."""
    letters = "".join(
        letter
        for test, letter in (
            (stat.S_ISDIR, "d"),
            (stat.S_ISLNK, "L"),
            (stat.S_ISBLK, "D"),
            (stat.S_ISCHR, "Dc"),
            (stat.S_ISFIFO, "p"),
            (stat.S_ISSOCK, "S"),
        )
        if test(mode)
    )
    letters += "".join(
        letter
        for bit, letter in ((stat.S_ISUID, "u"), (stat.S_ISGID, "g"), (stat.S_ISVTX, "t"))
        if mode & bit
    )
    bits = "".join(char if mode & (1 << (8 - index)) else "-" for index, char in enumerate("rwxrwxrwx"))
    return (letters or "-") + bits
