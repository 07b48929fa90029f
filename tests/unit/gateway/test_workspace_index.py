"""The files API's view of a version: folders implied by paths, found by bisect, at a cost bounded
by what a request shows however large the manifest; and the per-process cache of such views."""

from __future__ import annotations

from fleet_gateway.workspace_index import IndexCache, WorkspaceIndex
from fleet_shared.manifests import FileEntry, Manifest, entry_bytes


def entry(path: str, size: int = 1) -> FileEntry:
    return FileEntry(path, size, 0o644, "0" * 64, 0)


class CountingList(list[str]):
    """The index's paths, counting every read of one (bisect's included)."""

    reads = 0

    def __getitem__(self, index: object) -> object:  # type: ignore[override]
        CountingList.reads += 1
        return super().__getitem__(index)  # type: ignore[index]


def index_of(*paths: str) -> WorkspaceIndex:
    return WorkspaceIndex(Manifest.of(entry(p) for p in paths).entries)


def names(index: WorkspaceIndex, folder: str, limit: int = 1000) -> tuple[list[tuple[str, bool]], bool]:
    found, more = index.children(folder, limit)
    return [(name, file is None) for name, file in found], more


def test_folders_are_implied_by_paths_and_a_prefix_is_not_a_folder() -> None:
    index = index_of("memory/big/x", "memory/big-file", "memory/big.txt", "memory/bigger/y", "top.txt")
    assert names(index, "memory") == (
        [("big", True), ("big-file", False), ("big.txt", False), ("bigger", True)],
        False,
    )
    assert names(index, "memory/big") == ([("x", False)], False)
    assert index.is_folder("memory/big") and not index.is_folder("memory/bi")
    assert not index.is_folder("memory/big.txt") and index.file("memory/big.txt") is not None
    assert index.file("memory/big") is None and index.file("memory/bi") is None
    root, more = names(index, "")
    layout = [("artifacts", True), ("attachments", True), ("memory", True), ("skills", True)]
    assert root == [*layout, ("top.txt", False)]
    assert not more


def test_the_layout_folders_exist_in_an_empty_version_and_count_toward_a_limit() -> None:
    empty = index_of()
    assert all(empty.is_folder(name) for name in ("memory", "skills", "attachments", "artifacts"))
    assert names(empty, "memory") == ([], False)
    assert names(empty, "", limit=2) == ([("artifacts", True), ("attachments", True)], True)
    assert names(index_of("zz.txt"), "", limit=4)[1] is True  # a fifth child remains


def test_a_listing_reads_a_bounded_number_of_paths_however_many_lie_below() -> None:
    many = [f"memory/big/f{n:06d}" for n in range(100_000)]
    index = index_of(*many, "memory/a.txt", "memory/z/y.txt", *(f"memory/z/{n}" for n in range(50_000)))
    index.paths = CountingList(index.paths)
    CountingList.reads = 0
    assert names(index, "memory") == ([("a.txt", False), ("big", True), ("z", True)], False)
    assert CountingList.reads < 120  # a few binary searches, not a scan of 150,000 paths
    CountingList.reads = 0
    found, more = index.children("memory/big", 1000)
    assert more and len(found) == 1000 and found[0][0] == "f000000"
    assert CountingList.reads < 1000 * 25  # a step (one search at most) per child shown


def test_a_manifest_not_in_path_order_is_sorted_once() -> None:
    index = WorkspaceIndex((entry("memory/b"), entry("memory/a"), entry("memory/b")))
    assert index.paths == ["memory/a", "memory/b"]
    assert names(index, "memory") == ([("a", False), ("b", False)], False)


def test_the_cache_keeps_recent_indexes_within_its_byte_bound() -> None:
    one = entry_bytes("a")  # every single-letter name here weighs the same
    cache = IndexCache(max_bytes=5 * one)
    small, other, large = index_of("a", "b"), index_of("c", "d", "e"), index_of(*"fghijkl")
    cache.put("small", small)
    cache.put("other", other)
    assert cache.get("small") is small  # now the most recent
    cache.put("large", large)  # 7 entries: over the bound alone, kept alone
    assert cache.get("other") is None and cache.get("small") is None and cache.get("large") is large
    assert cache.held == 7 * one
    cache.put("small", small)
    assert cache.get("large") is None and cache.get("small") is small and cache.held == 2 * one


def test_long_paths_weigh_what_they_cost() -> None:
    """Review of #28: a bound in entries let a few manifests of long paths hold gigabytes."""
    cache = IndexCache(max_bytes=4 * entry_bytes("a"))
    short = index_of("a", "b")
    cache.put("short", short)
    cache.put("long", index_of("x" * 600))  # one entry, but longer than the rest of the bound
    assert cache.get("short") is None and cache.held == entry_bytes("x" * 600)
