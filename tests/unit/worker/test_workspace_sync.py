"""A workspace folder kept in step with its versions (fleet_worker.sandbox.sync), on a real folder
and a real blob store (the local backend): materialise makes the folder hold exactly a manifest
whatever was there, capture records what changed and stores only that."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from fleet_shared import manifests
from fleet_shared.blobs import BlobStore
from fleet_shared.manifests import MAX_PATH_BYTES, FileEntry, Manifest, entry_bytes, object_key
from fleet_worker.sandbox.provider import OverQuota
from fleet_worker.sandbox.sync import Baseline, capture, materialise
from fleet_worker.workspace_objects import WorkspaceObjects


@pytest.fixture
def objects(tmp_path: Path) -> WorkspaceObjects:
    from obstore.store import LocalStore

    folder = tmp_path / "store"
    folder.mkdir()
    blobs = BlobStore(LocalStore(prefix=folder, mkdir=True), "local", folder)
    return WorkspaceObjects(blobs, tmp_path / "cache", 0)


def listing(folder: Path) -> dict[str, bytes | str]:
    found: dict[str, bytes | str] = {}
    for path in sorted(folder.rglob("*")):
        relative = str(path.relative_to(folder))
        if path.is_symlink():
            found[relative] = "link"
        elif path.is_dir():
            found[relative] = "dir"
        else:
            found[relative] = path.read_bytes()
    return found


def first_version(folder: Path, objects: WorkspaceObjects) -> tuple[Manifest, Baseline]:
    (folder / "memory" / "deep").mkdir(parents=True)
    (folder / "memory" / "note.txt").write_text("v1")
    (folder / "memory" / "deep" / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(folder / "memory" / "deep" / "run.sh", 0o750)
    for name in ("skills", "attachments", "artifacts"):
        (folder / name).mkdir()
    captured = capture(folder, {}, objects, 100)
    return captured.manifest, captured.known


def test_capture_records_regular_files_and_stores_each_by_content(
    tmp_path: Path, objects: WorkspaceObjects
) -> None:
    folder = tmp_path / "ws"
    folder.mkdir()
    (folder / "memory").mkdir()
    os.symlink("/etc/passwd", folder / "memory" / "link")
    os.mkfifo(folder / "memory" / "pipe")
    manifest, _known = first_version(folder, objects)
    assert [(e.path, e.size, e.mode) for e in manifest.entries] == [
        ("memory/deep/run.sh", 10, 0o750),
        ("memory/note.txt", 2, 0o644),
    ]
    local = objects.blobs.local_path(object_key(hashlib.sha256(b"v1").hexdigest()))
    assert local is not None and local.read_bytes() == b"v1"


def test_a_file_changed_behind_the_same_size_and_mtime_is_still_seen(
    tmp_path: Path, objects: WorkspaceObjects
) -> None:
    """A cell may restore a file's mtime after changing it; the ctime, which no process can set,
    still moves: the change is stored, and an unchanged file is not stored again."""
    folder = tmp_path / "ws"
    folder.mkdir()
    manifest, known = first_version(folder, objects)
    note = folder / "memory" / "note.txt"
    kept_object = objects.blobs.local_path(object_key(manifest.by_path()["memory/deep/run.sh"].sha256))
    assert kept_object is not None
    inode = kept_object.stat().st_ino
    before = note.stat()
    note.write_text("v2")
    os.utime(note, ns=(before.st_atime_ns, before.st_mtime_ns))
    captured = capture(folder, known, objects, 100)
    assert captured.manifest.by_path()["memory/note.txt"].sha256 == hashlib.sha256(b"v2").hexdigest()
    assert captured.added_bytes == 2
    assert kept_object.stat().st_ino == inode  # the unchanged file was not put again


def test_materialise_makes_the_folder_hold_exactly_the_version(
    tmp_path: Path, objects: WorkspaceObjects
) -> None:
    source = tmp_path / "source"
    source.mkdir()
    manifest, _known = first_version(source, objects)
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "memory" / "stale" / "deeper").mkdir(parents=True)
    (folder / "memory" / "stale" / "deeper" / "x").write_text("old")
    (folder / "memory" / "note.txt").mkdir()  # a folder where the version has a file
    (folder / "memory" / "deep").write_text("a file where the version has a folder")
    os.symlink("/etc", folder / "artifacts")  # a link where a layout folder belongs
    known = materialise(folder, manifest, {}, objects, None)
    assert listing(folder) == {
        "artifacts": "dir",
        "attachments": "dir",
        "memory": "dir",
        "memory/deep": "dir",
        "memory/deep/run.sh": b"#!/bin/sh\n",
        "memory/note.txt": b"v1",
        "skills": "dir",
    }
    entry = manifest.by_path()["memory/deep/run.sh"]
    info = (folder / "memory" / "deep" / "run.sh").stat()
    assert (info.st_mode & 0o777, info.st_mtime_ns) == (0o750, entry.mtime_ns)
    assert set(known) == {"memory/deep/run.sh", "memory/note.txt"}
    again = capture(folder, known, objects, 100)  # nothing changed since: nothing stored
    assert again.manifest == manifest and again.added_bytes == 0


def test_a_warm_folder_keeps_what_it_holds_and_corrects_what_someone_changed(
    tmp_path: Path, objects: WorkspaceObjects
) -> None:
    folder = tmp_path / "ws"
    folder.mkdir()
    manifest, known = first_version(folder, objects)
    run_sh = folder / "memory" / "deep" / "run.sh"
    inode = run_sh.stat().st_ino
    (folder / "memory" / "note.txt").write_text("v1 changed by a Run that never committed")
    (folder / "memory" / "leftover.txt").write_text("x")
    known = materialise(folder, manifest, known, objects, None)
    assert (folder / "memory" / "note.txt").read_text() == "v1"
    assert not (folder / "memory" / "leftover.txt").exists()
    assert run_sh.stat().st_ino == inode  # untouched: not written again
    assert known["memory/deep/run.sh"].ino == inode


def test_capture_over_the_room_stores_nothing(tmp_path: Path, objects: WorkspaceObjects) -> None:
    folder = tmp_path / "ws"
    folder.mkdir()
    (folder / "memory").mkdir()
    (folder / "memory" / "big.bin").write_bytes(b"x" * 1000)
    (folder / "artifacts").mkdir()
    (folder / "artifacts" / "counted.txt").write_bytes(b"y" * 5000)
    with pytest.raises(OverQuota, match="too much: 1000"):
        capture(
            folder,
            {},
            objects,
            100,
            room=lambda size: f"too much: {size}",
            counted=frozenset({"artifacts/counted.txt"}),
        )
    stored = objects.blobs.folder
    assert stored is not None and not (stored / "workspaces").exists()


def test_a_path_longer_than_a_manifest_keeps_is_left_out(tmp_path: Path, objects: WorkspaceObjects) -> None:
    """Review of #28: 100,000 files of 4 KiB paths made a manifest of 400 MB that every claim
    and every files API request decoded. A path past MAX_PATH_BYTES is not kept."""
    folder = tmp_path / "ws"
    kept = "memory/" + "/".join(["k" * 200] * 5) + "/f"  # 1,013 bytes
    dropped = "memory/" + "/".join(["d" * 220] * 5) + "/f"  # 1,113 bytes
    for relative in (kept, dropped):
        (folder / relative).parent.mkdir(parents=True)
        (folder / relative).write_text("x")
    assert len(kept) <= MAX_PATH_BYTES < len(dropped)
    manifest = capture(folder, {}, objects, 100).manifest
    assert [entry.path for entry in manifest.entries] == [kept]


def test_a_capture_stops_at_the_manifests_byte_bound(
    tmp_path: Path, objects: WorkspaceObjects, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "ws"
    (folder / "memory").mkdir(parents=True)
    names = [f"memory/{i:03d}-" + "n" * 200 for i in range(30)]
    for relative in names:
        (folder / relative).write_text("x")
    monkeypatch.setattr(manifests, "MAX_MANIFEST_BYTES", 10 * entry_bytes(names[0]))
    manifest = capture(folder, {}, objects, 100).manifest
    assert len(manifest.entries) == 10 and len(manifest.encode()) <= manifests.MAX_MANIFEST_BYTES


def test_the_byte_bound_counts_a_path_as_json_encodes_it(
    tmp_path: Path, objects: WorkspaceObjects, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of #36: a control character is one byte of UTF-8 and six of JSON, so a bound on
    UTF-8 let a manifest grow six times past it."""
    folder = tmp_path / "ws"
    (folder / "memory").mkdir(parents=True)
    names = [f"memory/{i:03d}-" + "\x01" * 200 for i in range(30)]
    for relative in names:
        (folder / relative).write_text("x")
    monkeypatch.setattr(manifests, "MAX_MANIFEST_BYTES", 10 * (len(names[0]) + manifests.ENTRY_BYTES))
    manifest = capture(folder, {}, objects, 100).manifest
    assert 0 < len(manifest.entries) < 10 and len(manifest.encode()) <= manifests.MAX_MANIFEST_BYTES


def test_a_manifest_round_trips_its_canonical_encoding() -> None:
    entries = [FileEntry("b", 1, 0o600, "a" * 64, 5), FileEntry("a", 2, 0o644, "b" * 64, 6)]
    manifest = Manifest.of(entries)
    assert [e.path for e in manifest.entries] == ["a", "b"]
    decoded = Manifest.decode(manifest.encode())
    assert decoded == manifest and decoded.sha256 == Manifest.of(reversed(entries)).sha256


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files away")
def test_a_materialised_folder_is_the_sandboxs_as_a_sanitize_pass_leaves_it(
    tmp_path: Path, objects: WorkspaceObjects
) -> None:
    """The lease skips its sanitize walk after materialise, so materialise owns everything to
    the sandbox's uid and strips setuid and setgid from what it keeps."""
    source = tmp_path / "source"
    source.mkdir()
    manifest, known = first_version(source, objects)
    folder = tmp_path / "ws"
    folder.mkdir()
    known = materialise(folder, manifest, {}, objects, None)
    os.chmod(folder / "memory" / "deep", 0o2755)  # a setgid folder the host had left
    os.chown(folder / "memory" / "note.txt", 0, 0)
    materialise(folder, manifest, known, objects, 200_123)
    entries = [folder, *folder.rglob("*")]
    assert {(p.stat().st_uid, p.stat().st_gid) for p in entries} == {(200_123, 200_123)}
    assert not any(p.stat().st_mode & (0o4000 | 0o2000) for p in entries)
