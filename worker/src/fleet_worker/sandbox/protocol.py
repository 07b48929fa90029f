"""Host-side frame codec for the sandbox REPL: a 4-byte big-endian length, then one JSON object."""

from __future__ import annotations

import json
import math
import os
import select
import struct
import time
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

from fleet_worker.sandbox.errors import FrameTimeout, FrameTooLarge, SandboxCrashed

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 * 1024 * 1024
READ_CHUNK_BYTES = 1024 * 1024
WATCH_SECONDS = 0.1  # a read's watch runs this often while nothing arrives
Watch = Callable[[], None]


def json_fallback(value: object) -> object:
    """Make a non-JSON value sendable: pydantic-style models dump themselves, the rest become str."""
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        try:
            return dump(mode="json")
        except TypeError:
            return dump()
    return str(value)


def encode_frame(message: Mapping[str, Any], *, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Encode one message; raises FrameTooLarge rather than send something the REPL will reject."""
    # ASCII-escaped JSON survives lone surrogates that strict UTF-8 encoding would refuse.
    payload = json.dumps(message, default=json_fallback, separators=(",", ":")).encode("ascii")
    if len(payload) > max_bytes:
        raise FrameTooLarge(f"message of {len(payload)} bytes exceeds the {max_bytes}-byte frame limit")
    return HEADER.pack(len(payload)) + payload


def decode_payload(payload: bytes) -> dict[str, Any]:
    """Decode a frame body; anything but one JSON object means the protocol is broken."""
    try:
        message = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SandboxCrashed(f"REPL sent a frame that is not valid JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise SandboxCrashed(f"REPL sent a {type(message).__name__} frame instead of an object")
    return message


def read_frame(
    source: int | BinaryIO,
    deadline: float | None = None,
    *,
    max_bytes: int = MAX_FRAME_BYTES,
    watch: Watch | None = None,
) -> dict[str, Any]:
    """Read one frame; FrameTimeout past `deadline`, SandboxCrashed on EOF or an oversize frame.

    With a deadline the source must be an fd or an unbuffered file: readiness is polled on the fd.
    `watch` runs about every WATCH_SECONDS while nothing arrives (it raises to give up early).
    """
    if isinstance(source, int) and deadline is not None:
        return read_whole_frame(source, deadline, max_bytes, watch)
    (length,) = HEADER.unpack(read_exactly(source, HEADER.size, deadline, watch))
    if length > max_bytes:
        raise SandboxCrashed(f"REPL announced a {length}-byte frame, over the {max_bytes} limit")
    return decode_payload(read_exactly(source, length, deadline, watch))


FIRST_READ_BYTES = 16 * 1024  # most frames fit; small enough that the buffer is no mmap


def read_whole_frame(fd: int, deadline: float, max_bytes: int, watch: Watch | None) -> dict[str, Any]:
    """One frame in as few reads as it arrived in (a cell's result: one poll and one read).

    The REPL sends one frame and then waits for the host's answer (or the next cell), so bytes
    past the frame's end can only come from a REPL that broke the protocol."""
    buffer = bytearray()
    want = FIRST_READ_BYTES
    while len(buffer) < HEADER.size:
        buffer += read_some(fd, want, deadline, watch)
    (length,) = HEADER.unpack_from(buffer)
    if length > max_bytes:
        raise SandboxCrashed(f"REPL announced a {length}-byte frame, over the {max_bytes} limit")
    end = HEADER.size + length
    if len(buffer) > end:
        raise SandboxCrashed("REPL sent a second frame before the host answered the first")
    while len(buffer) < end:
        buffer += read_some(fd, min(end - len(buffer), READ_CHUNK_BYTES), deadline, watch)
    return decode_payload(bytes(buffer[HEADER.size :]))


def read_some(source: int | BinaryIO, want: int, deadline: float | None, watch: Watch | None) -> bytes:
    """Between 1 and `want` bytes (an fd: once it is readable); EOF means the REPL is gone."""
    while True:
        try:
            if isinstance(source, int):
                wait_ready(source, deadline, writing=False, watch=watch)
                chunk = os.read(source, want)
            else:
                chunk = source.read(want)
        except BlockingIOError:
            continue
        except (OSError, ValueError) as exc:
            raise SandboxCrashed(f"cannot read from the REPL: {exc}") from exc
        if not chunk:
            raise SandboxCrashed("REPL closed its frame channel (EOF)")
        return chunk


def read_exactly(
    source: int | BinaryIO, size: int, deadline: float | None, watch: Watch | None = None
) -> bytes:
    """Read exactly `size` bytes; EOF before that means the REPL is gone."""
    if not isinstance(source, int) and deadline is not None:
        source = source.fileno()
    buffer = bytearray()
    while len(buffer) < size:
        buffer += read_some(source, min(size - len(buffer), READ_CHUNK_BYTES), deadline, watch)
    return bytes(buffer)


def write_all(fd: int, data: bytes, deadline: float | None) -> None:
    """Write every byte to `fd`, polling for room so a stuck reader cannot block past `deadline`."""
    view = memoryview(data)
    while view:
        wait_ready(fd, deadline, writing=True)
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            continue
        except OSError as exc:
            raise SandboxCrashed(f"cannot write to the REPL: {exc}") from exc
        view = view[written:]


def wait_ready(fd: int, deadline: float | None, *, writing: bool, watch: Watch | None = None) -> None:
    """Block until `fd` is readable/writable; poll() rather than select() has no 1024-fd ceiling."""
    if deadline is None:
        return
    poller = select.poll()
    poller.register(fd, select.POLLOUT if writing else select.POLLIN)
    while True:
        remaining = deadline - time.monotonic()
        wait = remaining if watch is None else min(remaining, WATCH_SECONDS)
        if poller.poll(max(0, math.ceil(wait * 1000))):
            return
        if remaining <= wait:
            raise FrameTimeout("timed out waiting for the REPL")
        assert watch is not None
        watch()
