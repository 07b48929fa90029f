"""The sandbox frame codec (host and driver sides) and the bwrap argv builder."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet_worker.sandbox import repl_main
from fleet_worker.sandbox.errors import FrameTimeout, FrameTooLarge, SandboxCrashed
from fleet_worker.sandbox.jail import (
    DRIVER_FD_PLACEHOLDER,
    DRIVER_MOUNT,
    DRIVER_SOURCE,
    MASK_BYTES,
    OUTPUT_FD_PLACEHOLDER,
    SECCOMP_FD_PLACEHOLDER,
    SITE_MOUNT,
    THREAD_VARIABLES,
    WORKSPACE_MOUNT,
    LocalSandboxConfig,
    bwrap_command,
    resolve_python,
    usr_local,
)
from fleet_worker.sandbox.protocol import (
    FIRST_READ_BYTES,
    HEADER,
    MAX_FRAME_BYTES,
    encode_frame,
    json_fallback,
    read_frame,
    write_all,
)

REPO = Path(__file__).resolve().parents[3]


def write_frame(target: int | io.BytesIO, message: dict[str, object]) -> None:
    """One frame to an fd or a buffer, as the host writes them (encode_frame, then write_all)."""
    data = encode_frame(message)
    if isinstance(target, int):
        write_all(target, data, None)
    else:
        target.write(data)


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read_fd, write_fd = os.pipe()
    yield read_fd, write_fd
    for fd in (read_fd, write_fd):
        with contextlib.suppress(OSError):
            os.close(fd)


class Model:
    def model_dump(self, mode: str = "python") -> dict[str, object]:
        return {"kind": "model", "mode": mode}


def test_round_trip_over_a_pipe(pipe: tuple[int, int]) -> None:
    read_fd, write_fd = pipe
    message = {"op": "execute", "id": 7, "code": "print('é ☃ \\ud800')", "variables": {"a": [1, 2.5]}}
    write_frame(write_fd, message)
    assert read_frame(read_fd, time.monotonic() + 1) == message
    write_frame(write_fd, {"op": "shutdown"})
    assert read_frame(read_fd, time.monotonic() + 1) == {"op": "shutdown"}


def test_a_frame_larger_than_the_first_read_and_one_in_pieces_arrive_whole(pipe: tuple[int, int]) -> None:
    read_fd, write_fd = pipe
    big = {"op": "result", "id": 1, "final": {"text": "x" * (3 * FIRST_READ_BYTES)}}
    writer = threading.Thread(target=write_frame, args=(write_fd, big))
    writer.start()  # more than the pipe holds: the reader must read while it is written
    assert read_frame(read_fd, time.monotonic() + 5) == big
    writer.join()
    data = encode_frame({"op": "result", "id": 2})
    for piece in (data[:2], data[2:7], data[7:]):
        os.write(write_fd, piece)
        time.sleep(0.01)  # each piece its own read
    assert read_frame(read_fd, time.monotonic() + 1) == {"op": "result", "id": 2}


def test_a_second_frame_before_the_host_answered_means_crashed(pipe: tuple[int, int]) -> None:
    # The REPL waits for an answer after each frame; more bytes are a broken (or hostile) REPL.
    read_fd, write_fd = pipe
    os.write(write_fd, encode_frame({"op": "tool_call", "name": "a"}) + encode_frame({"op": "result"}))
    with pytest.raises(SandboxCrashed, match="second frame"):
        read_frame(read_fd, time.monotonic() + 1)


def test_round_trip_over_file_objects() -> None:
    buffer = io.BytesIO()
    write_frame(buffer, {"op": "ready", "pid": 1})
    buffer.seek(0)
    assert read_frame(buffer) == {"op": "ready", "pid": 1}


def test_non_json_values_fall_back_to_model_dump_then_str() -> None:
    buffer = io.BytesIO()
    write_frame(buffer, {"model": Model(), "path": Path("/x"), "set": {1}})
    buffer.seek(0)
    assert read_frame(buffer) == {
        "model": {"kind": "model", "mode": "json"},
        "path": "/x",
        "set": "{1}",
    }
    assert str(json_fallback(object())).startswith("<object object")


def test_read_times_out_at_the_deadline(pipe: tuple[int, int]) -> None:
    read_fd, _write_fd = pipe
    started = time.monotonic()
    with pytest.raises(FrameTimeout):
        read_frame(read_fd, started + 0.2)
    assert 0.15 < time.monotonic() - started < 2


def test_oversize_frame_is_rejected(pipe: tuple[int, int]) -> None:
    read_fd, write_fd = pipe
    os.write(write_fd, HEADER.pack(MAX_FRAME_BYTES + 1))
    with pytest.raises(SandboxCrashed, match="limit"):
        read_frame(read_fd, time.monotonic() + 1)


def test_oversize_message_is_refused_before_sending() -> None:
    with pytest.raises(FrameTooLarge):
        encode_frame({"blob": "x" * 100}, max_bytes=50)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="eof-before-header"),
        pytest.param(b"\x00\x00", id="eof-inside-header"),
        pytest.param(HEADER.pack(10) + b'{"op"', id="eof-inside-payload"),
    ],
)
def test_eof_means_crashed(pipe: tuple[int, int], data: bytes) -> None:
    read_fd, write_fd = pipe
    os.write(write_fd, data)
    os.close(write_fd)
    with pytest.raises(SandboxCrashed, match="EOF"):
        read_frame(read_fd, time.monotonic() + 1)


@pytest.mark.parametrize("payload", [b"[1, 2]", b"not json", b"\xff\xfe"])
def test_payload_that_is_not_an_object_means_crashed(pipe: tuple[int, int], payload: bytes) -> None:
    read_fd, write_fd = pipe
    os.write(write_fd, HEADER.pack(len(payload)) + payload)
    with pytest.raises(SandboxCrashed):
        read_frame(read_fd, time.monotonic() + 1)


def test_driver_codec_speaks_the_host_format(pipe: tuple[int, int]) -> None:
    read_fd, write_fd = pipe
    channel = repl_main.Channel(read_fd, write_fd)
    channel.send({"op": "result", "id": 1, "final": {"answer": {3, 4}}})
    assert read_frame(read_fd, time.monotonic() + 1) == {
        "op": "result",
        "id": 1,
        "final": {"answer": [3, 4]},
    }
    write_frame(write_fd, {"op": "tool_result", "ok": True, "value": "ü"})
    assert channel.receive() == {"op": "tool_result", "ok": True, "value": "ü"}


ODD_VALUES = [
    {"op": "result", "id": 7, "final": {"answer": "plain"}},
    {"text": "ü ✓ \U0001f600 \ud800 lone surrogate", "quote": '"\\\n\t\x00\x1f'},
    {"numbers": [0, -1, 2**70, 1.5, -0.0, 1e300, float("inf"), float("-inf"), float("nan")]},
    {"nested": [[[{"a": [None, True, False]}]]], "empty": [{}, [], ""]},
    {"keys": {3: "int key", 2.5: "float key", True: "bool key", None: "none key"}},
    {"fallback": {frozenset({1}), (2, 3)}, "object": object()},
]


@pytest.mark.parametrize("value", ODD_VALUES)
def test_driver_json_is_the_json_module_s(value: dict[str, object]) -> None:
    # The driver runs the stdlib's C codec without the json package; it must write and read
    # exactly what json.dumps and json.loads would.
    import json

    expected = json.dumps(value, default=repl_main.jsonable, separators=(",", ":"))
    if "object" in value:  # str() of an object differs by its address only
        value = {**value, "object": "same"}
        expected = json.dumps(value, default=repl_main.jsonable, separators=(",", ":"))
    text = repl_main.encode_json(value)
    assert text == expected
    assert repr(repl_main.decode_json(text)) == repr(json.loads(expected))  # repr: NaN != NaN
    spaced = json.dumps(json.loads(expected), indent=2)
    assert repr(repl_main.decode_json(f" {spaced}\n")) == repr(json.loads(spaced))


MALFORMED = ["", "   ", "{", '{"a": 1} x', "[1,]", '{"a": NaNx}', "\x00", '"abc', "[1 2]", '{"a" 1}', '"\\x"']


def test_driver_json_refuses_what_json_refuses() -> None:
    # In its own `python -I -S`, as in the jail: the json package is not loaded there, and the C
    # scanner's error for a malformed value depends on it (a SystemError on 3.11 without it).
    import json

    for text in MALFORMED:
        with pytest.raises(ValueError):
            json.loads(text)
    script = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("driver", {str(DRIVER_SOURCE)!r})
driver = importlib.util.module_from_spec(spec)
spec.loader.exec_module(driver)
assert "json" not in sys.modules and "json.decoder" not in sys.modules
for text in {MALFORMED!r}:
    try:
        driver.decode_json(text)
    except ValueError:
        continue
    raise SystemExit(f"accepted {{text!r}}")
print("refused them all")
"""
    argv = [sys.executable, "-I", "-S", "-c", script]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
    assert done.stdout == "refused them all\n", done.stderr


def test_driver_json_refuses_a_cycle() -> None:
    looped: list[object] = []
    looped.append(looped)
    with pytest.raises(ValueError, match="ircular reference"):
        repl_main.encode_json({"value": looped})
    assert repl_main.encode_json({"value": [1]}) == '{"value":[1]}'  # the next one starts clean


def bind_sources(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg in {"--bind", "--ro-bind", "--dev-bind"}]


def pairs(argv: list[str], flag: str) -> list[tuple[str, str]]:
    return [(argv[i + 1], argv[i + 2]) for i, arg in enumerate(argv) if arg == flag]


@pytest.mark.parametrize(
    ("python", "executable", "prefix"),
    [
        pytest.param("/usr/bin/python3", "/usr/bin/python3", None, id="system-python"),
        pytest.param(
            "/opt/py311/bin/python3.11",
            "/opt/py311/bin/python3.11",
            "/opt/py311",
            id="python-outside-usr",
        ),
    ],
)
def test_bwrap_command(python: str, executable: str, prefix: str | None, tmp_path: Path) -> None:
    cfg = LocalSandboxConfig(memory_mb=512, max_processes=32, max_file_mb=8)
    workspace = tmp_path / "ws"
    argv = bwrap_command(cfg, workspace, python, DRIVER_SOURCE, uid=201234, bwrap="/usr/bin/bwrap")
    options, command = argv[: argv.index("--")], argv[argv.index("--") + 1 :]

    assert options[0] == "/usr/bin/bwrap"
    for flag in ("--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session"):
        assert flag in options
    assert "--share-net" not in options
    assert options[options.index("--uid") + 1] == "201234"
    assert options[options.index("--gid") + 1] == "201234"
    assert options[options.index("--seccomp") + 1] == SECCOMP_FD_PLACEHOLDER
    # /tmp is a tmpfs of bounded size (--size applies to the --tmpfs right after it).
    tmp = options.index("/tmp")
    assert options[tmp - 3 : tmp] == ["--size", str(cfg.tmp_mb * 2**20), "--tmpfs"]
    # The environment is cleared first, then exactly these variables are set.
    setenvs = [i for i, arg in enumerate(options) if arg == "--setenv"]
    assert options.index("--clearenv") < min(setenvs)
    assert dict(pairs(options, "--setenv")) == {
        "PATH": "/usr/bin:/bin",
        "HOME": "/workspace",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        # Native libraries' threads: one per CPU the sandbox gets (sandbox.local.cpus = 1).
        **dict.fromkeys(THREAD_VARIABLES, "1"),
    }
    assert SITE_MOUNT not in options  # no packages configured: nothing of them is mounted

    assert pairs(options, "--bind") == [(str(workspace), WORKSPACE_MOUNT)]
    ro_binds = pairs(options, "--ro-bind")
    assert ("/usr", "/usr") in ro_binds
    # The driver is copied in through an fd (no host path of it in the jail's mount table).
    assert (DRIVER_FD_PLACEHOLDER, DRIVER_MOUNT) in pairs(options, "--ro-bind-data")
    assert options[options.index("--chdir") + 1] == WORKSPACE_MOUNT
    assert options[options.index("--proc") + 1] == "/proc"
    assert options[options.index("--dev") + 1] == "/dev"
    if prefix is None:
        assert len(ro_binds) == 1 + sum(1 for _src, dst in ro_binds if dst in {"/bin", "/lib"})
    else:
        assert (prefix, prefix) in ro_binds

    # Nothing of /etc, /root or the repository.
    for source in bind_sources(options):
        assert not source.startswith(("/etc", "/root", "/home"))
        assert not REPO.is_relative_to(source)
        assert not Path(source).is_relative_to(REPO)

    assert command == [
        executable,
        "-I",
        "-S",
        "-B",
        DRIVER_MOUNT,
        "--memory-mb",
        "512",
        "--max-processes",
        "32",
        "--max-file-mb",
        "8",
        "--output-fd",
        OUTPUT_FD_PLACEHOLDER,
    ]


def test_bwrap_command_mounts_the_packages_read_only_and_names_them_to_the_driver(tmp_path: Path) -> None:
    site = tmp_path / "env" / "site"
    cfg = LocalSandboxConfig(python_site=str(site), preload=("pandas", "numpy"), cpus=2.5)
    argv = bwrap_command(cfg, tmp_path / "ws", "/usr/bin/python3", DRIVER_SOURCE, uid=1)
    options, command = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    assert (str(site), SITE_MOUNT) in pairs(options, "--ro-bind")
    assert str(site) not in [source for source, _ in pairs(options, "--bind")]  # never writable
    # Mounted before the root is made read-only (bwrap creates the mount point in it).
    root_read_only = [i for i, arg in enumerate(options) if arg == "--remount-ro" and options[i + 1] == "/"]
    assert options.index(SITE_MOUNT) < root_read_only[0]
    assert command[-4:] == ["--site", SITE_MOUNT, "--preload", "pandas,numpy"]
    assert dict(pairs(options, "--setenv"))["OPENBLAS_NUM_THREADS"] == "3"


def test_bwrap_command_mirrors_merged_usr_symlinks(tmp_path: Path) -> None:
    argv = bwrap_command(LocalSandboxConfig(), tmp_path, "/usr/bin/python3", DRIVER_SOURCE, uid=1)
    for name in ("bin", "lib", "lib64", "sbin"):
        host = Path("/") / name
        if host.is_symlink():
            assert (os.readlink(host), f"/{name}") in pairs(argv, "--symlink")


def test_bwrap_command_runs_a_symlinked_python_from_its_real_path(tmp_path: Path) -> None:
    # A venv's bin/python is a symlink; the jail must exec the real file, not the venv.
    link = tmp_path / "venv" / "bin" / "python"
    link.parent.mkdir(parents=True)
    link.symlink_to("/usr/bin/python3")
    argv = bwrap_command(LocalSandboxConfig(), tmp_path, str(link), DRIVER_SOURCE, uid=1)
    executable = argv[argv.index("--") + 1]
    assert executable == os.path.realpath("/usr/bin/python3")
    assert all(not source.startswith(str(tmp_path / "venv")) for source in bind_sources(argv))


def test_resolve_python() -> None:
    assert resolve_python(LocalSandboxConfig(python="/opt/python/bin/python3")) == "/opt/python/bin/python3"
    auto = resolve_python(LocalSandboxConfig())
    if Path("/usr/bin/python3").exists():
        assert auto == "/usr/bin/python3"
    else:
        assert ".venv" not in auto and os.access(auto, os.X_OK)


def test_usr_local_shows_only_what_an_interpreter_there_needs(tmp_path: Path) -> None:
    local = tmp_path / "local"
    for path in ("bin/python3.11", "bin/pip", "lib/libpython3.11.so.1.0", "lib/libother.so", "etc/x"):
        (local / path).parent.mkdir(parents=True, exist_ok=True)
        (local / path).touch()
    for folder in ("lib/python3.11/site-packages/pip", "lib/python3.12", "games"):
        (local / folder).mkdir(parents=True)
    stdlib = local / "lib/python3.11"

    argv = usr_local(str(local / "bin/python3.11"), local)

    assert argv[:4] == ["--size", MASK_BYTES, "--tmpfs", str(local)]
    assert {src for src, _dst in pairs(argv, "--ro-bind")} == {
        str(local / "bin/python3.11"),
        str(local / "lib/libpython3.11.so.1.0"),
        str(stdlib),
    }
    assert all(src == dst for src, dst in pairs(argv, "--ro-bind"))
    assert argv[argv.index(str(stdlib / "site-packages")) - 1] == "--tmpfs"  # its listing hidden
    assert [argv[i + 1] for i, arg in enumerate(argv) if arg == "--remount-ro"] == [
        str(local),
        str(stdlib / "site-packages"),
    ]
    # An interpreter elsewhere needs nothing of it: /usr/local is empty in the jail.
    assert usr_local("/usr/bin/python3", local) == [
        "--size",
        MASK_BYTES,
        "--tmpfs",
        str(local),
        "--remount-ro",
        str(local),
    ]
    assert usr_local("/usr/bin/python3", tmp_path / "missing") == []
