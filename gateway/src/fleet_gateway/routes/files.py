"""The files API: a session's workspace, read-only, never a step outside it.

Every read goes through `fleet_shared.confined` (directory fds, O_NOFOLLOW, regular files only):
`..`, absolute paths, symlinks (even one swapped in mid-request), FIFOs, devices, unknown and
foreign sessions all answer the same 404. Responses carry workspace-relative paths only.
"""

from __future__ import annotations

import asyncio
import codecs
import itertools
import os
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import QueryParameter
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_gateway.errors import ApiError, not_found
from fleet_gateway.routes.sessions import load_session
from fleet_gateway.schemas import NO_NUL
from fleet_gateway.state import GatewayState
from fleet_shared.confined import DIR_FLAGS, OutsideTree, opened_inside, parts_of
from fleet_shared.workspaces import find_workspace

MAX_LIST = 1000
MAX_TREE_ENTRIES = 2000
SessionId = Annotated[str, QueryParameter(max_length=64)]
PathParam = Annotated[str, QueryParameter(max_length=4096, pattern=NO_NUL)]


class Entry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: str
    path: str
    type: Literal["file", "directory"]
    byte_size: int = 0
    modified_at: str = ""
    children: list[Entry] | None = None


class Listing(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    path: str
    items: list[Entry]
    truncated: bool


class Content(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    path: str
    content: str
    cursor: str
    next_cursor: str | None
    byte_size: int


class Tree(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    root: Entry
    truncated: bool


def normalized(parts: list[str]) -> str:
    return "/".join(parts)


def entry(name: str, path: str, info: os.stat_result) -> Entry:
    kind: Literal["file", "directory"] = "directory" if stat.S_ISDIR(info.st_mode) else "file"
    return Entry(
        name=name,
        path=path,
        type=kind,
        byte_size=info.st_size if kind == "file" else 0,
        modified_at=timestamp(info.st_mtime),
    )


def timestamp(seconds: float) -> str:
    """ISO 8601, or "" for a time no calendar holds (a sandbox may set any mtime)."""
    try:
        return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")
    except (ValueError, OverflowError, OSError):
        return ""


def addressable(name: str) -> bool:
    """A name a client can see and ask for again: valid Unicode (no undecodable bytes)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def children(fd: int, prefix: str, limit: int) -> tuple[list[Entry], list[tuple[str, str]], int, bool]:
    """The regular files and directories among the first `limit` entries of an open directory
    (sorted by name), the (name, path) of its subdirectories, how many entries were read, and
    whether more remain.

    Every entry read counts toward `limit`, shown or not (a link, a FIFO, an undecodable name):
    a folder of millions of links costs what `limit` entries cost. The directory is read
    incrementally and never past `limit` + 1 entries; the cut follows the directory's own order,
    which is stable while the folder is unchanged, and what was read is sorted."""
    with os.scandir(fd) as entries:
        read = list(itertools.islice(entries, limit))
        more = next(entries, None) is not None
    found: list[Entry] = []
    folders: list[tuple[str, str]] = []
    for item in sorted(read, key=lambda item: item.name):
        name = item.name
        if not addressable(name):
            continue  # bytes that are not UTF-8: not listed, as a link is not
        if not (item.is_file(follow_symlinks=False) or item.is_dir(follow_symlinks=False)):
            continue  # links, FIFOs and the like are not shown (the type needs no stat)
        try:
            info = item.stat(follow_symlinks=False)  # lstat relative to `fd`
        except FileNotFoundError:
            continue
        if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
            continue  # swapped for a link or a FIFO since it was read
        path = f"{prefix}/{name}" if prefix else name
        found.append(entry(name, path, info))
        if stat.S_ISDIR(info.st_mode):
            folders.append((name, path))
    return found, folders, len(read), more


def list_dir(root: Path, parts: list[str]) -> tuple[list[Entry], bool]:
    with opened_inside(root, parts) as (fd, info):
        if not stat.S_ISDIR(info.st_mode):
            raise FileNotFoundError(normalized(parts))
        found, _folders, _read, truncated = children(fd, normalized(parts), MAX_LIST)
        return found, truncated


def stat_path(root: Path, parts: list[str]) -> Entry:
    with opened_inside(root, parts) as (_fd, info):
        return entry(parts[-1] if parts else "", normalized(parts), info)


def read_text(root: Path, parts: list[str], offset: int, max_chars: int) -> tuple[str, int | None, int]:
    """At most `max_chars` characters from byte `offset`, never split inside a character; the
    offset to go on from (None at the end) and the file's size. Invalid UTF-8 shows as U+FFFD."""
    with opened_inside(root, parts) as (fd, info):
        if not stat.S_ISREG(info.st_mode):
            raise FileNotFoundError(normalized(parts))
        size = info.st_size
        if offset > size:
            raise ApiError(422, "validation_error", "cursor: past the end of the file")
        raw = os.pread(fd, max_chars + 3, offset)  # room for one whole character past the page
    at_end = offset + len(raw) >= size
    for spare in range(4):  # drop trailing bytes until the page holds at most max_chars
        chunk = raw[: len(raw) - spare]
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text = decoder.decode(chunk, final=at_end and spare == 0)
        if len(text) <= max_chars:
            break
    if "\x00" in text:
        raise ApiError(415, "unsupported_media_type", "this file is binary; download it instead")
    pending, _flag = decoder.getstate()  # the start of a character cut off by the page's end
    following = offset + len(chunk) - len(pending)
    if following == offset and offset < size:  # no whole character fits: step over one byte
        text, following = "\ufffd", offset + 1
    return text, following if following < size else None, size


def build_tree(root: Path, parts: list[str], depth: int) -> tuple[Entry, bool]:
    budget = [MAX_TREE_ENTRIES]
    with opened_inside(root, parts) as (fd, info):
        if not stat.S_ISDIR(info.st_mode):
            raise FileNotFoundError(normalized(parts))
        top = entry(parts[-1] if parts else "", normalized(parts), info)
        kids, truncated = subtree(fd, normalized(parts), depth, budget)
        return msgspec.structs.replace(top, children=kids), truncated


def subtree(fd: int, prefix: str, depth: int, budget: list[int]) -> tuple[list[Entry], bool]:
    found, folders, read, truncated = children(fd, prefix, budget[0])
    budget[0] -= read
    if depth <= 1:
        return found, truncated
    deeper: dict[str, list[Entry]] = {}
    for name, path in folders:
        if budget[0] <= 0:
            truncated = True
            break
        try:
            child = os.open(name, DIR_FLAGS, dir_fd=fd)
        except OSError:
            continue  # swapped for a link or removed meanwhile
        try:
            deeper[path], cut = subtree(child, path, depth - 1, budget)
        finally:
            os.close(child)
        truncated = truncated or cut
    # A folder that was not walked (the budget ran out, or it vanished) has no `children`, as at
    # the depth limit; `[]` means walked and empty.
    return [
        msgspec.structs.replace(e, children=deeper[e.path]) if e.path in deeper else e for e in found
    ], truncated


class FilesController(Controller):
    path = "/api"

    async def workspace(
        self, db: AsyncSession, gw: GatewayState, session_id: str, path: str
    ) -> tuple[Path, list[str]]:
        session = await load_session(db, session_id)
        try:
            parts = parts_of(path)
        except OutsideTree:
            raise not_found("file") from None
        root = find_workspace(gw.settings.workspaces_dir, session.workspace_id)
        if root is None:
            raise not_found("file")  # no Turn has run in this session yet
        return root, parts

    @staticmethod
    async def confined(call: Any, *args: Any) -> Any:
        try:
            return await asyncio.to_thread(call, *args)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            raise not_found("file") from None

    @get("/files")
    async def list_files(
        self,
        *,
        db: NamedDependency[AsyncSession],
        gw: NamedDependency[GatewayState],
        session_id: SessionId,
        path: PathParam = "",
    ) -> Listing:
        root, parts = await self.workspace(db, gw, session_id, path)
        items, truncated = await self.confined(list_dir, root, parts)
        return Listing(session_id=session_id, path=normalized(parts), items=items, truncated=truncated)

    @get("/files/stat")
    async def stat_file(
        self,
        *,
        db: NamedDependency[AsyncSession],
        gw: NamedDependency[GatewayState],
        session_id: SessionId,
        path: PathParam = "",
    ) -> Entry:
        root, parts = await self.workspace(db, gw, session_id, path)
        found: Entry = await self.confined(stat_path, root, parts)
        return found

    @get("/files/content")
    async def file_content(
        self,
        *,
        db: NamedDependency[AsyncSession],
        gw: NamedDependency[GatewayState],
        session_id: SessionId,
        path: PathParam,
        max_chars: Annotated[int, QueryParameter(ge=1, le=200_000)] = 20_000,
        cursor: Annotated[str, QueryParameter(max_length=20, pattern=r"^[0-9]*$")] = "",
    ) -> Content:
        root, parts = await self.workspace(db, gw, session_id, path)
        offset = int(cursor or 0)
        text, following, size = await self.confined(read_text, root, parts, offset, max_chars)
        return Content(
            session_id=session_id,
            path=normalized(parts),
            content=text,
            cursor=str(offset),
            next_cursor=None if following is None else str(following),
            byte_size=size,
        )

    @get("/volume/tree")
    async def volume_tree(
        self,
        *,
        db: NamedDependency[AsyncSession],
        gw: NamedDependency[GatewayState],
        session_id: SessionId,
        root: PathParam = "",
        depth: Annotated[int, QueryParameter(ge=1, le=8)] = 3,
    ) -> Tree:
        folder, parts = await self.workspace(db, gw, session_id, root)
        top, truncated = await self.confined(build_tree, folder, parts, depth)
        return Tree(session_id=session_id, root=top, truncated=truncated)
