"""The files API: a session's workspace as one of its versions, read-only, from the database and
the blob store (never from a disk: the worker that ran a Turn may be anywhere, or gone).

A version is a manifest of regular files (fleet_shared.manifests); folders are what the files'
paths imply, plus the layout folders. A path is looked up in the manifest, never opened, so
`..`, absolute and odd paths, names no version holds, and unknown and foreign sessions all
answer the same 404. Responses carry workspace-relative paths only.
"""

from __future__ import annotations

import asyncio
import codecs
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Literal

import msgspec
from litestar import Controller, get
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, QueryParameter
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_gateway.errors import ApiError, not_found
from fleet_gateway.routes.artifacts import opened
from fleet_gateway.routes.sessions import load_session
from fleet_gateway.schemas import MAX_INT32, NO_NUL, WorkspaceVersionOut, WorkspaceVersionPage
from fleet_gateway.state import GatewayState
from fleet_gateway.streaming import iso
from fleet_gateway.workspace_index import EMPTY_INDEX, Child, WorkspaceIndex
from fleet_shared.confined import OutsideTree, parts_of
from fleet_shared.db import workspace_versions
from fleet_shared.db.models import WorkspaceManifest
from fleet_shared.ids import parse_uuid
from fleet_shared.manifests import FileEntry, object_key
from fleet_shared.tenancy import Principal

MAX_LIST = 1000
MAX_TREE_ENTRIES = 2000
SessionId = Annotated[str, QueryParameter(max_length=64)]
PathParam = Annotated[str, QueryParameter(max_length=4096, pattern=NO_NUL)]
VersionParam = Annotated[
    int | None,
    QueryParameter(
        ge=1, le=MAX_INT32, description="read the workspace as this version left it (default: the latest)"
    ),
]
RunIdParam = Annotated[
    str | None,
    QueryParameter(max_length=64, description="read the workspace as this Run of the session left it"),
]


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


@dataclass(frozen=True)
class Chosen:
    """Which version a request reads: `version`, the one `run_id` left, or (neither) the latest."""

    version: int | None
    run_id: str | None


def chosen_version(version: VersionParam = None, run_id: RunIdParam = None) -> Chosen:
    if version is not None and run_id is not None:
        raise ApiError(422, "validation_error", "version, run_id: give one of them, not both")
    return Chosen(version, run_id)


def timestamp(seconds: float) -> str:
    """ISO 8601, or "" for a time no calendar holds (a sandbox may set any mtime)."""
    try:
        return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")
    except (ValueError, OverflowError, OSError):
        return ""


def child_path(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def file_entry(entry: FileEntry) -> Entry:
    return Entry(
        name=entry.path.rpartition("/")[2],
        path=entry.path,
        type="file",
        byte_size=entry.size,
        modified_at=timestamp(entry.mtime_ns / 1e9),
    )


def folder_entry(path: str) -> Entry:
    """A folder: a version keeps no folders, so none has a size or a time of its own."""
    return Entry(name=path.rpartition("/")[2], path=path, type="directory")


def shown(folder: str, child: Child) -> Entry:
    name, entry = child
    return file_entry(entry) if entry is not None else folder_entry(child_path(folder, name))


def list_folder(index: WorkspaceIndex, folder: str) -> tuple[list[Entry], bool]:
    if not index.is_folder(folder):
        raise not_found("file")
    found, truncated = index.children(folder, MAX_LIST)
    return [shown(folder, child) for child in found], truncated


def stat_path(index: WorkspaceIndex, path: str) -> Entry:
    entry = index.file(path)
    if entry is not None:
        return file_entry(entry)
    if index.is_folder(path):
        return folder_entry(path)
    raise not_found("file")


def page_of(raw: bytes, offset: int, size: int, max_chars: int) -> tuple[str, int | None]:
    """At most `max_chars` characters of `raw` (the file's bytes from `offset`), never split
    inside a character, and the offset to go on from (None at the end). Invalid UTF-8 shows as
    U+FFFD."""
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
    return text, following if following < size else None


def build_tree(index: WorkspaceIndex, folder: str, depth: int) -> tuple[Entry, bool]:
    if not index.is_folder(folder):
        raise not_found("file")
    budget = [MAX_TREE_ENTRIES]
    kids, truncated = subtree(index, folder, depth, budget)
    return msgspec.structs.replace(folder_entry(folder), children=kids), truncated


def subtree(index: WorkspaceIndex, folder: str, depth: int, budget: list[int]) -> tuple[list[Entry], bool]:
    """Every entry looked at counts toward the budget, as in a listing."""
    found, truncated = index.children(folder, budget[0])
    budget[0] -= len(found)
    entries = [shown(folder, child) for child in found]
    if depth <= 1:
        return entries, truncated
    walked: list[Entry] = []
    for item in entries:
        if item.type == "file":
            walked.append(item)
        elif budget[0] <= 0:
            # A folder that was not walked (the budget ran out) has no `children`, as at the
            # depth limit; `[]` means walked and empty.
            walked.append(item)
            truncated = True
        else:
            kids, cut = subtree(index, item.path, depth - 1, budget)
            walked.append(msgspec.structs.replace(item, children=kids))
            truncated = truncated or cut
    return walked, truncated


class FilesController(Controller):
    path = "/api"
    dependencies = {"chosen": Provide(chosen_version, sync_to_thread=False)}

    async def workspace(
        self,
        db: AsyncSession,
        gw: GatewayState,
        caller: Principal,
        session_id: str,
        *,
        path: str,
        chosen: Chosen,
    ) -> tuple[WorkspaceIndex, str]:
        """The chosen version's index and the normalised path asked for."""
        session = await load_session(db, session_id, caller)
        try:
            parts = parts_of(path)
        except OutsideTree:
            raise not_found("file") from None
        run_id = None if chosen.run_id is None else parse_uuid(chosen.run_id)
        if chosen.run_id is not None and run_id is None:
            raise not_found("workspace version")
        row = await workspace_versions.version_row(
            db, session.workspace_id, version=chosen.version, run_id=run_id
        )
        if row is None:
            if chosen.version is None and chosen.run_id is None:
                return EMPTY_INDEX, "/".join(parts)  # no Turn has left a version yet
            raise not_found("workspace version")
        return await self.index_of(db, gw, row.manifest_sha256), "/".join(parts)

    @staticmethod
    async def index_of(db: AsyncSession, gw: GatewayState, sha256: str) -> WorkspaceIndex:
        index = gw.manifests.get(sha256)
        if index is not None:
            return index
        encoded = await db.scalar(select(WorkspaceManifest.entries).where(WorkspaceManifest.sha256 == sha256))
        if encoded is None:  # a foreign key makes this impossible; answered, not crashed on
            raise not_found("workspace version")
        index = await asyncio.to_thread(WorkspaceIndex.decode, encoded)  # a large one takes a while
        gw.manifests.put(sha256, index)
        return index

    @get("/files")
    async def list_files(
        self,
        *,
        db: NamedDependency[AsyncSession],
        gw: NamedDependency[GatewayState],
        caller: NamedDependency[Principal],
        chosen: NamedDependency[Chosen],
        session_id: SessionId,
        path: PathParam = "",
    ) -> Listing:
        index, folder = await self.workspace(db, gw, caller, session_id, path=path, chosen=chosen)
        items, truncated = list_folder(index, folder)
        return Listing(session_id=session_id, path=folder, items=items, truncated=truncated)

    @get("/files/stat")
    async def stat_file(
        self,
        *,
        db: NamedDependency[AsyncSession],
        gw: NamedDependency[GatewayState],
        caller: NamedDependency[Principal],
        chosen: NamedDependency[Chosen],
        session_id: SessionId,
        path: PathParam = "",
    ) -> Entry:
        index, found = await self.workspace(db, gw, caller, session_id, path=path, chosen=chosen)
        return stat_path(index, found)

    @get("/files/content")
    async def file_content(
        self,
        *,
        db: NamedDependency[AsyncSession],
        gw: NamedDependency[GatewayState],
        caller: NamedDependency[Principal],
        chosen: NamedDependency[Chosen],
        session_id: SessionId,
        path: PathParam,
        max_chars: Annotated[int, QueryParameter(ge=1, le=200_000)] = 20_000,
        cursor: Annotated[str, QueryParameter(max_length=20, pattern=r"^[0-9]*$")] = "",
    ) -> Content:
        index, found = await self.workspace(db, gw, caller, session_id, path=path, chosen=chosen)
        entry = index.file(found)
        if entry is None:
            raise not_found("file")
        offset = int(cursor or 0)
        if offset > entry.size:
            raise ApiError(422, "validation_error", "cursor: past the end of the file")
        end = min(entry.size, offset + max_chars + 3)  # room for one whole character past the page
        chunks = await opened(gw.blobs, object_key(entry.sha256), offset, end, what="file")
        raw = b"".join([chunk async for chunk in chunks])
        text, following = page_of(raw, offset, entry.size, max_chars)
        return Content(
            session_id=session_id,
            path=found,
            content=text,
            cursor=str(offset),
            next_cursor=None if following is None else str(following),
            byte_size=entry.size,
        )

    @get("/volume/tree")
    async def volume_tree(
        self,
        *,
        db: NamedDependency[AsyncSession],
        gw: NamedDependency[GatewayState],
        caller: NamedDependency[Principal],
        chosen: NamedDependency[Chosen],
        session_id: SessionId,
        root: PathParam = "",
        depth: Annotated[int, QueryParameter(ge=1, le=8)] = 3,
    ) -> Tree:
        index, folder = await self.workspace(db, gw, caller, session_id, path=root, chosen=chosen)
        top, truncated = build_tree(index, folder, depth)
        return Tree(session_id=session_id, root=top, truncated=truncated)

    @get("/sessions/{session_id:str}/workspace/versions")
    async def list_versions(
        self,
        *,
        db: NamedDependency[AsyncSession],
        caller: NamedDependency[Principal],
        session_id: FromPath[str],
        limit: Annotated[int, QueryParameter(ge=1, le=100)] = 50,
        before_version: Annotated[int | None, QueryParameter(ge=1, le=MAX_INT32)] = None,
    ) -> WorkspaceVersionPage:
        """The session's workspace versions, newest first: one per Turn that left its files."""
        session = await load_session(db, session_id, caller)
        rows = await workspace_versions.version_page(
            db, session.workspace_id, before_version=before_version, limit=limit
        )
        items = [WorkspaceVersionOut.of(row, iso) for row in rows]
        more = len(rows) == limit and rows[-1].version > 1
        return WorkspaceVersionPage(items, rows[-1].version if more else None)
