"""Trees that sandboxed code wrote are removed whatever their depth and modes, without following a
link; a child's scratch folder is held by a lock while its lease lives, and the sweep removes
exactly the ones nobody holds, also with several sweepers at once."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from fleet_worker.sandbox.removal import remove_tree
from fleet_worker.sandbox.scratch import LIVE, ScratchClaim, lock_of, sweep_scratch

REPO = Path(__file__).resolve().parents[3]
SOURCES = [str(REPO / "worker" / "src"), str(REPO / "shared" / "src")]
NOBODY = 65534


@pytest.fixture(scope="module")
def readable_sources() -> Iterator[list[str]]:
    """The sources, where another uid can read them (a checkout may sit in a 0700 folder)."""
    copy = Path(tempfile.mkdtemp(prefix="fleet-sources-"))
    copy.chmod(0o755)
    paths = []
    for source in SOURCES:
        target = copy / Path(source).parent.name
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        paths.append(str(target))
    for folder, _dirs, _files in os.walk(copy):
        os.chmod(folder, 0o755)
    yield paths
    shutil.rmtree(copy)


@pytest.fixture
def root() -> Iterator[Path]:
    """A folder another uid can pass through (pytest's own tmp folders are 0700 under /tmp)."""
    path = Path(tempfile.mkdtemp(prefix="fleet-removal-"))
    path.chmod(0o711)
    yield path
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)


def nest(folder: Path, depth: int, *, mode: int | None = None) -> None:
    """`depth` folders inside each other under `folder`, each with a file and a link in it,
    made through fds (the path would be far past PATH_MAX)."""
    folder.mkdir()
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in range(depth):
            os.mkdir("d", dir_fd=fd)
            with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "w") as f:
                f.write(str(level))
            os.symlink("/etc", "up", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            if mode is not None:
                os.fchmod(fd, mode)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)


def test_a_tree_two_thousand_folders_deep_is_removed(root: Path) -> None:
    tree = root / "tree"
    nest(tree, 2000)
    remove_tree(tree)
    assert list(root.iterdir()) == []
    assert Path("/etc/hostname").exists() or Path("/etc/passwd").exists()  # the links were not followed


def test_the_removal_holds_a_few_fds_whatever_the_depth(root: Path) -> None:
    """With an open-files limit of 32, a chain of 500 folders is removed (an fd per level, as
    os.fwalk holds, would run out)."""
    nest(root / "tree", 500)
    code = (
        "import resource, sys\nfrom pathlib import Path\nsys.path[:0] = sys.argv[2:]\n"
        "from fleet_worker.sandbox.removal import remove_tree\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))\nremove_tree(Path(sys.argv[1]))"
    )
    subprocess.run([sys.executable, "-c", code, str(root / "tree"), *SOURCES], check=True)
    assert list(root.iterdir()) == []


def test_links_are_removed_never_followed(root: Path) -> None:
    outside = root / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    tree = root / "tree"
    (tree / "inner").mkdir(parents=True)
    (tree / "to-folder").symlink_to(outside)
    (tree / "inner" / "to-file").symlink_to(outside / "keep.txt")
    os.mkfifo(tree / "inner" / "pipe")
    remove_tree(tree)
    assert sorted(p.name for p in root.iterdir()) == ["outside"]
    assert (outside / "keep.txt").read_text() == "keep"
    remove_tree(root / "missing")  # nothing there: nothing to do
    (root / "link").symlink_to(outside)
    remove_tree(root / "link")  # a link given as the tree: only the link goes
    assert (outside / "keep.txt").exists() and not (root / "link").is_symlink()


def test_folders_their_owner_cannot_read_or_write_are_removed(
    root: Path, readable_sources: list[str]
) -> None:
    """As the uid that made them (the sandbox's own, on a worker that is not root): folders of
    mode 000 and 500 at every level."""
    tree = root / "tree"
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None or not Path("/usr/bin/python3").exists():
            pytest.skip("needs setpriv and /usr/bin/python3 to act as another uid")
        drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        python = "/usr/bin/python3"
        os.chown(root, NOBODY, NOBODY)
    else:
        python, drop = sys.executable, []
    as_owner = [*drop, python, "-c"]
    make = (
        "import os, sys\nfd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
        "for level in range(50):\n    os.mkdir('d', dir_fd=fd)\n"
        "    os.close(os.open('f', os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))\n"
        "    child = os.open('d', os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)\n"
        "    os.fchmod(fd, 0o500 if level % 2 else 0)\n    os.close(fd)\n    fd = child"
    )
    tree.mkdir()
    if drop:
        os.chown(tree, NOBODY, NOBODY)
    subprocess.run([*as_owner, make, str(tree)], check=True)
    remove = (
        "import sys\nfrom pathlib import Path\nsys.path[:0] = sys.argv[2:]\n"
        "from fleet_worker.sandbox.removal import remove_tree\nremove_tree(Path(sys.argv[1]))"
    )
    subprocess.run([*as_owner, remove, str(tree), *readable_sources], check=True)
    assert list(root.iterdir()) == []


HOLD = (
    "import sys\nfrom pathlib import Path\nsys.path[:0] = sys.argv[2:]\n"
    "from fleet_worker.sandbox.scratch import ScratchClaim\n"
    "claim = ScratchClaim(Path(sys.argv[1]))\n(claim.folder / 'memory').mkdir(parents=True)\n"
    "print(claim.key, flush=True)\nsys.stdin.read()\n"
)


def hold_scratch(root: Path) -> tuple[subprocess.Popen[str], str]:
    """Another process (another worker on this host) holding a scratch folder of `root`; its key."""
    argv = [sys.executable, "-c", HOLD, str(root), *SOURCES]
    holder = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    return holder, holder.stdout.readline().strip()


def test_a_held_scratch_folder_is_kept_and_a_dead_holders_is_swept(root: Path) -> None:
    """Another process holds a scratch folder: the sweep keeps it. Once that process is killed,
    the next sweep removes the folder and its lock file."""
    holder, key = hold_scratch(root)
    try:
        assert sweep_scratch(root) == 0
        assert (root / f"scratch-{key}" / "memory").is_dir()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert sweep_scratch(root) == 1
    assert list(root.iterdir()) == []


def test_a_scratch_folder_held_in_this_process_is_kept_until_discarded(root: Path) -> None:
    claim = ScratchClaim(root)
    nest(claim.folder, 100)
    assert claim.key in LIVE and sweep_scratch(root) == 0
    claim.discard()
    assert claim.key not in LIVE and list(root.iterdir()) == []


def test_a_failed_removal_is_retried_by_the_sweep(root: Path) -> None:
    """The removal at release fails (an immutable file: EPERM even for root), the lease reports
    it and lets go; once the file can go, the sweep removes what is left."""
    if os.geteuid() != 0 or shutil.which("chattr") is None:
        pytest.skip("needs root and chattr to make a file nobody can remove")
    claim = ScratchClaim(root)
    stuck = claim.folder / "memory" / "stuck"
    stuck.parent.mkdir(parents=True)
    stuck.write_text("x")
    if subprocess.run(["chattr", "+i", str(stuck)], check=False).returncode != 0:
        pytest.skip("this filesystem has no immutable flag")
    try:
        with pytest.raises(OSError):
            claim.discard()
        assert lock_of(root, claim.key).exists() and sweep_scratch(root) == 0  # still stuck
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
    assert sweep_scratch(root) == 1
    assert list(root.iterdir()) == []


def sweep_in_child(root: str) -> int:
    return sweep_scratch(Path(root))


def test_several_sweepers_at_once_remove_each_leftover_once(root: Path) -> None:
    """Twenty folders left by a dead worker, four processes sweeping them at once: each is
    removed by exactly one, none fails, nothing is left."""
    for _ in range(20):
        claim = ScratchClaim(root)
        nest(claim.folder, 30)
        os.close(claim.lock_fd)  # as a crash would: the lock is let go, the folder stays
        LIVE.discard(claim.key)
    with ProcessPoolExecutor(4) as pool:
        removed = list(pool.map(sweep_in_child, [str(root)] * 4))
    assert sum(removed) == 20
    assert list(root.iterdir()) == []


def test_a_folder_without_a_lock_file_goes_only_once_it_is_old(root: Path) -> None:
    """Made by a worker older than the locks: left alone while it may still be in use."""
    (root / "scratch-0123abcd" / "memory").mkdir(parents=True)
    (root / "not-scratch").mkdir()
    assert sweep_scratch(root) == 0
    assert sweep_scratch(root, unlocked_folder_age=0.0) == 1
    assert sorted(p.name for p in root.iterdir()) == ["not-scratch"]
