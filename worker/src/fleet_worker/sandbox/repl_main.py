"""REPL driver that runs inside the sandbox: executes cells and speaks length-prefixed JSON frames.

Stdlib only. It runs under a bare `python3 -I -S` with no site-packages and no fleet code, so it
carries its own copy of the frame codec (4-byte big-endian length, then one UTF-8 JSON object).

Frames it receives: `execute`, `tool_result`, `shutdown`. Frames it sends: `ready` (once, after
setup), `tool_call` (a cell called a host tool and blocks for the reply) and `result` (per cell).
"""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import os
import resource
import signal
import struct
import sys
import traceback
import types
from typing import Any, NoReturn

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 * 1024 * 1024
RESERVED_NAMES = frozenset({"SUBMIT", "__builtins__"})
# Frames of this file are driver plumbing, never shown in a cell's traceback.
DRIVER_FILE = __file__


class Submitted(BaseException):
    """Raised by SUBMIT to end the cell at once; BaseException so `except Exception` misses it."""

    def __init__(self, values: dict[str, Any]) -> None:
        super().__init__("SUBMIT")
        self.values = values


class Channel:
    """The frame pipes to the host, on fds nothing in the cell writes to by accident."""

    def __init__(self, fd_in: int, fd_out: int) -> None:
        self.fd_in = fd_in
        self.fd_out = fd_out

    def send(self, message: dict[str, Any]) -> None:
        payload = json.dumps(message, default=jsonable, separators=(",", ":")).encode("ascii")
        if len(payload) > MAX_FRAME_BYTES:
            raise ValueError(f"message of {len(payload)} bytes exceeds the frame limit")
        data = memoryview(HEADER.pack(len(payload)) + payload)
        while data:
            data = data[os.write(self.fd_out, data) :]

    def receive(self) -> dict[str, Any] | None:
        """The next message, or None when the host closed the channel."""
        header = self.read_exactly(HEADER.size)
        if header is None:
            return None
        (length,) = HEADER.unpack(header)
        if length > MAX_FRAME_BYTES:
            fatal(f"host sent a {length}-byte frame, over the limit")
        payload = self.read_exactly(length)
        if payload is None:
            fatal("host closed the channel mid-frame")
        message = json.loads(payload.decode("utf-8"))
        if not isinstance(message, dict):
            fatal("host sent a frame that is not a JSON object")
        return message

    def read_exactly(self, size: int) -> bytes | None:
        buffer = bytearray()
        while len(buffer) < size:
            chunk = os.read(self.fd_in, size - len(buffer))
            if not chunk:
                return None
            buffer += chunk
        return bytes(buffer)

    def call_tool(self, name: str, kwargs: dict[str, Any]) -> Any:
        self.send({"op": "tool_call", "name": name, "kwargs": kwargs})
        reply = self.receive()
        if reply is None:
            os._exit(0)
        if reply.get("op") != "tool_result":
            fatal(f"expected tool_result, got {reply.get('op')!r}")
        if reply.get("ok"):
            return reply.get("value")
        raise RuntimeError(str(reply.get("error")))


class CappedOutput(io.TextIOBase):
    """stdout/stderr for a cell: keeps the first `limit` characters and only counts the rest."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.parts: list[str] = []
        self.size = 0
        self.truncated = False

    # Class attributes shadow TextIOBase's read-only properties of the same names.
    encoding = "utf-8"
    errors = "replace"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        room = self.limit - self.size
        if len(text) > room:
            self.truncated = True
        if room > 0:
            piece = text[:room]
            self.parts.append(piece)
            self.size += len(piece)
        return len(text)

    def getvalue(self) -> str:
        return "".join(self.parts)


class Repl:
    """One persistent namespace; each execute frame runs one cell in it."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}

    def execute(self, request: dict[str, Any]) -> dict[str, Any]:
        code = request.get("code", "")
        output_fields = request.get("output_fields")
        variables = request.get("variables") or {}
        self.namespace.update(
            {name: value for name, value in variables.items() if name not in RESERVED_NAMES}
        )
        for name, params in (request.get("tools") or {}).items():
            if name.isidentifier() and name not in RESERVED_NAMES:
                self.namespace[name] = make_tool(self.channel, name, list(params))
        self.namespace["SUBMIT"] = make_submit(output_fields)

        output = CappedOutput(int(request.get("max_output_chars", 10_000)))
        reply: dict[str, Any] = {"op": "result", "id": request.get("id")}
        compiled: types.CodeType | None = None
        saved = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = output
        try:
            compiled = compile(code, "<cell>", "exec")
            exec(compiled, self.namespace)
        except Submitted as submitted:
            reply["final"] = submitted.values
        except BaseException as exc:  # SystemExit, KeyboardInterrupt too: report, keep the REPL
            reply["error"] = describe(exc, compiled, code)
        finally:
            sys.stdout, sys.stderr = saved
        reply["stdout"] = output.getvalue()
        reply["truncated"] = output.truncated
        return reply


def make_tool(channel: Channel, name: str, params: list[str]) -> Any:
    """A stub that maps positional args onto the host tool's parameter names, then calls it."""

    def tool(*args: Any, **kwargs: Any) -> Any:
        if len(args) > len(params):
            raise TypeError(f"{name}() takes {len(params)} positional arguments but {len(args)} were given")
        call = dict(zip(params, args, strict=False))
        for key, value in kwargs.items():
            if key in call:
                raise TypeError(f"{name}() got multiple values for argument {key!r}")
            call[key] = value
        return channel.call_tool(name, call)

    tool.__name__ = tool.__qualname__ = name
    return tool


def make_submit(output_fields: list[str] | None) -> Any:
    """SUBMIT(*args, **kwargs): positional values fill `output_fields` in order; ends the cell."""

    def SUBMIT(*args: Any, **kwargs: Any) -> None:
        if args and output_fields is None:
            raise TypeError("SUBMIT takes keyword arguments only here, e.g. SUBMIT(answer=...)")
        fields = output_fields or []
        if len(args) > len(fields):
            raise TypeError(f"SUBMIT takes at most {len(fields)} positional values: {fields}")
        values = dict(zip(fields, args, strict=False))
        for key, value in kwargs.items():
            if key in values:
                raise TypeError(f"SUBMIT got multiple values for {key!r}")
            values[key] = value
        if output_fields is not None:
            unknown = [key for key in values if key not in output_fields]
            missing = [key for key in output_fields if key not in values]
            if unknown or missing:
                raise TypeError(
                    f"SUBMIT expects exactly {output_fields}; missing {missing}, unexpected {unknown}"
                )
        raise Submitted(values)

    return SUBMIT


def describe(exc: BaseException, compiled: types.CodeType | None, code: str) -> dict[str, str]:
    """Type, message and a traceback of the cell's own frames (driver frames left out)."""
    cell_codes = nested_codes(compiled) if compiled is not None else set()
    lines = code.splitlines()
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frame_code = tb.tb_frame.f_code
        if frame_code.co_filename != DRIVER_FILE:
            line: str | None = None
            if frame_code in cell_codes:
                line = lines[tb.tb_lineno - 1].strip() if 0 < tb.tb_lineno <= len(lines) else ""
            elif frame_code.co_filename == "<cell>":
                line = ""  # code from an earlier cell: its source is no longer at hand
            frames.append(
                traceback.FrameSummary(frame_code.co_filename, tb.tb_lineno, frame_code.co_name, line=line)
            )
        tb = tb.tb_next
    text = ""
    if frames:
        text = "Traceback (most recent call last):\n"
        text += "".join(traceback.StackSummary.from_list(frames).format())
    text += "".join(traceback.format_exception_only(type(exc), exc))
    try:
        message = str(exc)
    except Exception:
        message = f"<unprintable {type(exc).__name__}>"
    return {"type": type(exc).__name__, "message": message, "traceback": text}


def nested_codes(code: types.CodeType) -> set[types.CodeType]:
    """The cell's code object and every function/class body compiled inside it."""
    found = {code}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= nested_codes(const)
    return found


def jsonable(value: object) -> object:
    """JSON fallback for values leaving the sandbox: sets become lists, the rest str."""
    if isinstance(value, set | frozenset):
        return list(value)
    return str(value)


def fatal(reason: str) -> NoReturn:
    """The protocol is broken beyond repair: say why on stderr and die (the host sees EOF)."""
    os.write(2, f"repl_main: {reason}\n".encode())
    os._exit(3)


def apply_limits(memory_mb: int, max_processes: int, max_file_mb: int) -> None:
    """Cap address space, processes and file size for this process and everything it starts."""
    # Oversized writes must fail with EFBIG in the cell, not kill the REPL with SIGXFSZ.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    for limit, value in (
        (resource.RLIMIT_AS, memory_mb * 1024 * 1024),
        (resource.RLIMIT_FSIZE, max_file_mb * 1024 * 1024),
    ):
        if value > 0:
            lower(limit, value)
    if max_processes > 0:
        # Best effort: some hosts refuse it; the sandbox's pid namespace still bounds the tree.
        with contextlib.suppress(OSError, ValueError):
            lower(resource.RLIMIT_NPROC, max_processes)


def lower(limit: int, value: int) -> None:
    """Set both soft and hard limit to `value`, never above the existing hard limit."""
    _soft, hard = resource.getrlimit(limit)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(limit, (value, value))


def parse_args(argv: list[str]) -> dict[str, int]:
    options = {"--memory-mb": 0, "--max-processes": 0, "--max-file-mb": 0}
    for flag, value in zip(argv[::2], argv[1::2], strict=False):
        if flag in options:
            options[flag] = int(value)
    return options


def main() -> int:
    # Frames travel on private copies of the original stdin/stdout. fd 0 becomes /dev/null and
    # fd 1 joins fd 2, so nothing the cell (or a subprocess) prints can corrupt a frame.
    frame_in, frame_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    options = parse_args(sys.argv[1:])
    apply_limits(options["--memory-mb"], options["--max-processes"], options["--max-file-mb"])

    channel = Channel(frame_in, frame_out)
    repl = Repl(channel)
    channel.send({"op": "ready", "pid": os.getpid(), "python": sys.version.split()[0]})
    while True:
        message = channel.receive()
        if message is None or message.get("op") == "shutdown":
            return 0
        if message.get("op") != "execute":
            fatal(f"unexpected op {message.get('op')!r}")
        reply = repl.execute(message)
        try:
            channel.send(reply)
        except (TypeError, ValueError, RecursionError) as exc:
            # The SUBMIT value could not be encoded (cyclic, too large): report it as the error.
            reply.pop("final", None)
            reply["error"] = {
                "type": type(exc).__name__,
                "message": f"cannot send the cell result: {exc}",
                "traceback": "",
            }
            channel.send(reply)


if __name__ == "__main__":
    sys.exit(main())
