"""The REPL inside the sandbox: a supervisor that owns the host channel, and an interpreter child
that runs the cells.

Stdlib only. It runs under a bare `python3 -I -S` with no site-packages and no fleet code, so it
carries its own copy of the frame codec (4-byte big-endian length, then one UTF-8 JSON object).

- The **supervisor** holds the frames to and from the host. It is not dumpable, so no other
  process of the sandbox can open its file descriptors through /proc: user code can never write
  a frame to the host. It relays the child's tool calls and results after checking their shape,
  kills every process a cell left behind, and replaces a child that died or was stopped.
- The **interpreter child** runs the cells in one persistent namespace. Its stdout and stderr are
  a pipe the host reads directly (the host caps and keeps it, even if the cell is killed).

Host → supervisor: `execute`, `tool_result`, `shutdown`. Supervisor → host: `ready`, `tool_call`,
`result` (`{id, final?, error?}`; the output travels on the output pipe).
"""

from __future__ import annotations

# Every REPL start imports these, inside the Turn's latency and the worker's CPU: C modules where
# the stdlib module would pull in more (`socket`, `signal` and `threading` load enum and
# functools; `json` loads re; `contextlib` loads collections). ADR 0019 has the measurement.
import _json
import _signal  # type: ignore[import-not-found]  # no stub: the C half of `signal`
import _socket
import _thread
import builtins
import io
import os
import resource
import select
import struct
import sys
import types

# `typing` is for the type checker only; `traceback` is imported by the first cell that fails.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 * 1024 * 1024
CONTAINERS = (dict, list, tuple, set, frozenset)
RESERVED_NAMES = frozenset({"SUBMIT", "__builtins__"})
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 1, 4, 36
WATCH_SECONDS = 0.5  # how often the supervisor looks at a running child (stopped? gone?)
# Values leaving the interpreter nest at most this deep: the host's checks recurse, and a deeper
# value would cost it (or this supervisor) a RecursionError instead of a clean refusal.
MAX_NESTING = 100
# A request this small always fits a unix socket's send buffer (over 200 KiB by default), so it
# can be written to a stopped child without blocking.
QUEUED_REQUEST_BYTES = 32 * 1024
STOPPED = "the REPL process was stopped (SIGSTOP); it was killed and restarted, so its state was reset"
# Frames of this file are driver plumbing, never shown in a cell's traceback.
DRIVER_FILE = __file__


class suppress:  # contextlib.suppress, without importing contextlib
    def __init__(self, *kinds: type[BaseException]) -> None:
        self.kinds = kinds

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_details: object) -> bool:
        return kind is not None and issubclass(kind, self.kinds)


class JsonOptions:
    """What the stdlib's C JSON scanner reads from json.JSONDecoder: json.loads' defaults."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}.__getitem__


# The C codec that json.dumps and json.loads run on, used without the json package (its modules
# import re). Same text as json.dumps(value, default=jsonable, separators=(",", ":")): ASCII
# only, NaN and Infinity allowed, a cycle refused; the same values as json.loads.
SCAN_JSON = _json.make_scanner(JsonOptions)  # type: ignore[arg-type]  # it reads these attributes
JSON_WHITESPACE = " \t\n\r"


def encode_json(value: object) -> str:
    encoder = _json.make_encoder(
        {}, jsonable, _json.encode_basestring_ascii, None, ":", ",", False, False, True
    )  # a fresh one each time: its record of the containers it is inside must start empty
    return "".join(encoder(value, 0))


def decode_json(text: str) -> Any:
    text = text.strip(JSON_WHITESPACE)
    try:
        value, end = SCAN_JSON(text, 0)
    except Exception:
        # StopIteration where no value starts; for a malformed one, the scanner raises the error
        # class of json.decoder, and CPython 3.11's finds it only if json is loaded (it is not
        # here: a SystemError then); a RecursionError for one nested too deep. All: unreadable.
        raise ValueError("malformed JSON") from None
    if end != len(text):
        raise ValueError("extra data after the JSON value")
    return value


class Submitted(BaseException):
    """Raised by SUBMIT to end the cell at once; BaseException so `except Exception` misses it."""

    def __init__(self, values: dict[str, Any]) -> None:
        super().__init__("SUBMIT")
        self.values = values


class Channel:
    """Length-prefixed JSON frames over a pair of file descriptors."""

    def __init__(self, fd_in: int, fd_out: int) -> None:
        self.fd_in = fd_in
        self.fd_out = fd_out
        # A cell's threads may call tools too: one call (its frame out, its reply in) at a time.
        self.lock = _thread.allocate_lock()
        # Why receive() last gave None for a frame that arrived ("" for EOF): what the frame broke.
        self.refused = ""

    def send(self, message: dict[str, Any]) -> None:
        self.write(self.encode(message))

    @staticmethod
    def encode(message: dict[str, Any]) -> bytes:
        if nests_deeper(message, MAX_NESTING):
            raise ValueError(f"the value nests more than {MAX_NESTING} levels deep")
        payload = encode_json(message).encode("ascii")
        if len(payload) > MAX_FRAME_BYTES:
            raise ValueError(f"message of {len(payload)} bytes exceeds the frame limit")
        return HEADER.pack(len(payload)) + payload

    def write(self, frame: bytes) -> None:
        data = memoryview(frame)
        while data:
            data = data[os.write(self.fd_out, data) :]

    def receive(self) -> dict[str, Any] | None:
        """The next message; None when the other side closed the channel or broke the format."""
        return self.receive_frame(keep=False)[0]

    def receive_frame(self, *, keep: bool = True) -> tuple[dict[str, Any] | None, bytes]:
        """The next message and (`keep`) its frame as it came, to pass on without encoding it
        again; a frame not kept is not copied (a tool's result can be large)."""
        self.refused = ""
        header = self.read_exactly(HEADER.size)
        if header is None:
            return None, b""
        (length,) = HEADER.unpack(header)
        if length > MAX_FRAME_BYTES:  # refused on the header: nothing of its body is read
            self.refused = f"a frame of {length} bytes, over the {MAX_FRAME_BYTES}-byte limit"
            return None, b""
        payload = self.read_exactly(length)
        if payload is None:
            return None, b""
        try:
            message = decode_json(payload.decode("utf-8"))
        except Exception:  # malformed, too deep, or too big to hold: the frame is unreadable
            self.refused = "a frame that is not JSON"
            return None, b""
        if not isinstance(message, dict):
            self.refused = "a frame that is not a JSON object"
            return None, b""
        return message, (header + payload if keep else b"")

    def read_exactly(self, size: int) -> bytes | None:
        buffer = bytearray()
        while len(buffer) < size:
            try:
                chunk = os.read(self.fd_in, size - len(buffer))
            except OSError:
                return None
            if not chunk:
                return None
            buffer += chunk
        return bytes(buffer)

    def call_tool(self, name: str, kwargs: dict[str, Any]) -> Any:
        with self.lock:
            self.send({"op": "tool_call", "name": name, "kwargs": kwargs})
            reply = self.receive()
        if reply is None or reply.get("op") != "tool_result":
            os._exit(3)  # the supervisor is gone or confused: nothing sensible remains to do
        if reply.get("ok"):
            return reply.get("value")
        raise RuntimeError(str(reply.get("error")))


# --- the interpreter child ------------------------------------------------------------------------


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
        reply: dict[str, Any] = {"op": "result", "id": request.get("id")}
        compiled: types.CodeType | None = None
        try:
            compiled = compile(code, "<cell>", "exec")
            exec(compiled, self.namespace)
        except Submitted as submitted:
            reply["final"] = submitted.values
        except BaseException as exc:  # SystemExit, KeyboardInterrupt too: report, keep the REPL
            reply["error"] = describe(exc, compiled, code)
        finally:
            flush_output()
        return reply


def flush_output() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with suppress(Exception):
            if stream is not None:
                stream.flush()


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
        flush_output()  # what the cell printed so far reaches the host in order
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
    try:
        message = str(exc)
    except Exception:
        message = f"<unprintable {type(exc).__name__}>"
    try:
        text = cell_traceback(exc, compiled, code)
    except BaseException:  # no memory left to load or run the formatter (the cell hit its limit)
        text = f"{type(exc).__name__}: {message}\n"
    return {"type": type(exc).__name__, "message": message, "traceback": text}


def cell_traceback(exc: BaseException, compiled: types.CodeType | None, code: str) -> str:
    import traceback  # here, not at start: a REPL whose cells never fail never pays for it

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
    return text + "".join(traceback.format_exception_only(type(exc), exc))


def nested_codes(code: types.CodeType) -> set[types.CodeType]:
    """The cell's code object and every function/class body compiled inside it."""
    found = {code}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= nested_codes(const)
    return found


def nests_deeper(value: object, limit: int) -> bool:
    """Whether containers inside `value` nest more than `limit` levels (checked without
    recursion, so no depth can break the check itself)."""
    stack: list[tuple[Any, int]] = [(value, 0)] if isinstance(value, CONTAINERS) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, CONTAINERS))
    return False


def jsonable(value: object) -> object:
    """JSON fallback for values leaving the sandbox: sets become lists, the rest str."""
    if isinstance(value, set | frozenset):
        return list(value)
    return str(value)


def child_main(sock: int, modules: str = "") -> NoReturn:
    """The interpreter: stdout/stderr are the output pipe (fds 1 and 2), frames go to the supervisor.
    `modules` are imported once it said it is ready, so the REPL's start does not wait for them;
    the first request waits in the socket until they are in."""
    with suppress(OSError):
        prctl(PR_SET_PDEATHSIG, _signal.SIGKILL)  # never outlive the supervisor
        # Dumpable again (fork kept the supervisor's setting): the cell may read its own
        # /proc/self; nothing of the supervisor's is in this process any more.
        prctl(PR_SET_DUMPABLE, 1)
    stdio = Stdio()
    os.waitpid = noting_kills(WAITPID)
    channel = Channel(sock, sock)
    repl = Repl(channel)
    channel.send({"op": "ready"})
    preload(modules)
    while True:
        with channel.lock:
            message = channel.receive()
        if message is None or message.get("op") != "execute":
            os._exit(0)
        stdio.restore()
        reap_children()  # what the supervisor killed after the last cell: not the cell's news
        KILLED.clear()
        reply = repl.execute(message)
        reap_children()
        if KILLED:
            reply["killed"] = list(KILLED)
        with channel.lock:
            try:
                channel.send(reply)
            except (TypeError, ValueError, RecursionError) as exc:
                # The SUBMIT value could not be encoded (cyclic, too deep, too large): that is the error.
                reply.pop("final", None)
                why = f"cannot send the cell result: {exc}"
                reply["error"] = {"type": type(exc).__name__, "message": why}
                channel.send(reply)


STDIO_COPIES_BELOW = 1024


class Stdio:
    """The interpreter's fds 0-2 (/dev/null, then the output pipe twice) and sys.stdout and
    sys.stderr over them, put back before every cell: a cell that closed or replaced them
    leaves the next one able to print. Copies are kept, with their identity, on the highest fds
    under STDIO_COPIES_BELOW (or a lower fd limit), away from the low ones a cell's own files
    take and its loops over them; when a cell took those too, the interpreter ends, and the
    supervisor replaces it."""

    def __init__(self) -> None:
        top = min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], STDIO_COPIES_BELOW)
        self.copies = [os.dup2(fd, top - 3 + fd, inheritable=False) for fd in (0, 1, 2)]
        self.identities = [self.identity(fd) for fd in self.copies]
        self.writers()

    @staticmethod
    def identity(fd: int) -> tuple[int, int]:
        info = os.fstat(fd)
        return info.st_dev, info.st_ino

    def writers(self) -> None:
        # Text that cannot be encoded (a lone surrogate) is escaped, never an error in the cell.
        self.stdout = sys.stdout = io.TextIOWrapper(
            io.FileIO(1, "w", closefd=False), "utf-8", "backslashreplace", write_through=True
        )
        self.stderr = sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), "utf-8", "backslashreplace", write_through=True
        )

    def restore(self) -> None:
        try:
            for fd, (copy, identity) in enumerate(zip(self.copies, self.identities, strict=True)):
                if self.identity(copy) != identity:
                    raise OSError("a copy of the REPL's stdio was replaced")
                with suppress(OSError):
                    if self.identity(fd) == identity:
                        continue
                os.dup2(copy, fd)
        except OSError:
            os._exit(4)  # nothing left to print with: a fresh interpreter is the only way on
        if self.stdout.closed or self.stderr.closed:
            self.writers()
        else:
            sys.stdout, sys.stderr = self.stdout, self.stderr


# The interpreter's children that died by SIGKILL during the cell, as the cell's own waits or
# the reaping at its end saw them: the host names them in the output when the REPL's memory
# limit killed something meanwhile.
KILLED: list[int] = []
MAX_KILLED = 64
WAITPID = os.waitpid  # the C function, whatever a cell makes of os.waitpid


def note_kill(pid: int, status: int) -> None:
    killed = pid > 0 and os.WIFSIGNALED(status) and os.WTERMSIG(status) == _signal.SIGKILL
    if killed and len(KILLED) < MAX_KILLED:
        KILLED.append(pid)


def noting_kills(waitpid: Any) -> Any:
    """os.waitpid (subprocess and multiprocessing wait with it) that notes a child's SIGKILL."""

    def noted_waitpid(pid: int, options: int) -> tuple[int, int]:
        reaped, status = waitpid(pid, options)
        note_kill(reaped, status)
        return reaped, status

    noted_waitpid.__name__ = noted_waitpid.__qualname__ = "waitpid"
    return noted_waitpid


def reap_children() -> None:
    """Reap every child of the interpreter that has ended: one the cell never waited for stays
    a zombie otherwise, counted against the REPL's processes for as long as the REPL lives.
    The supervisor cannot: it reaps only what is reparented to it (it is the subreaper)."""
    while True:
        try:
            pid, status = WAITPID(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid <= 0:
            return
        note_kill(pid, status)


# --- the supervisor -------------------------------------------------------------------------------


class Supervisor:
    def __init__(self, host: Channel, output_fd: int, preload: str = "") -> None:
        self.host = host
        self.output_fd = output_fd
        self.preload = preload
        self.child_pid = 0
        self.child: Channel | None = None
        self.census = Census(-1)

    def start_child(self) -> None:
        # A socket, not pipes: a cell may reopen its own pipes through /proc/self/fd and write
        # frames into its own input; a socket cannot be opened that way.
        parent_end, child_end = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:  # the child: nothing of the host channel survives into it
            try:
                for fd in (self.host.fd_in, self.host.fd_out, parent_end.fileno()):
                    os.close(fd)
                os.dup2(self.output_fd, 1)
                os.dup2(self.output_fd, 2)
                os.close(self.output_fd)
                child_main(child_end.detach(), self.preload)
            finally:
                os._exit(3)
        child_end.close()
        self.child_pid, sock = pid, parent_end.detach()
        self.child = Channel(sock, sock)
        self.census.close()
        self.census = Census(pid)
        if not self.await_child_ready():
            fatal("the interpreter did not start")

    def await_child_ready(self) -> bool:
        message = self.child.receive() if self.child is not None else None
        return message is not None and message.get("op") == "ready"

    def serve(self) -> None:
        while True:
            message, frame = self.host.receive_frame()
            if message is None or message.get("op") == "shutdown":
                return
            if message.get("op") != "execute":
                fatal(f"unexpected op {message.get('op')!r} from the host")
            self.run_cell(message, frame)

    def run_cell(self, request: dict[str, Any], frame: bytes) -> None:
        """`frame` is the host's request as it came: the child gets it unchanged (the host is
        trusted; a large context is not encoded a second time)."""
        request_id = request.get("id")
        assert self.child is not None
        if len(frame) <= QUEUED_REQUEST_BYTES:
            # Queued while the child is still stopped, so SIGCONT wakes it once, to read it.
            self.write_to_child(frame)
            signal_child(self.child_pid, _signal.SIGCONT)
        else:  # it could fill the socket: a stopped child would never drain it
            signal_child(self.child_pid, _signal.SIGCONT)
            self.write_to_child(frame)
        while True:
            message = self.next_from_child()
            if isinstance(message, str):  # the child is gone or broke the protocol
                self.replace_child()
                self.host.send({"op": "result", "id": request_id, "error": problem(message)})
                return
            # A child that wrote its own frames past the depth check broke the protocol.
            op = None if nests_deeper(message, MAX_NESTING) else message.get("op")
            call = encoded_call(message) if op == "tool_call" else None
            if call is not None:
                self.host.write(call)
                reply = self.host.receive()
                if reply is None or reply.get("op") != "tool_result":
                    fatal("expected a tool_result from the host")
                self.send_to_child(
                    {
                        "op": "tool_result",
                        "ok": bool(reply.get("ok")),
                        "value": reply.get("value"),
                        "error": reply.get("error"),
                    }
                )
            elif op == "result" and message.get("id") == request_id:
                # Threads the cell left running wait, stopped, for the next cell: between cells
                # nothing of the sandbox runs, writes to the workspace or prints. Stopped first,
                # and waited for, so that no thread of it starts a process while the leftovers
                # are looked for and killed.
                signal_child(self.child_pid, _signal.SIGSTOP)
                result = self.encoded_result(message, request_id)  # while the child stops
                if not (await_stop(self.child_pid) and self.census.alone()):
                    kill_leftovers(keep=self.child_pid)
                self.host.write(result)
                return
            else:
                self.replace_child()
                error = problem("the cell sent something the REPL protocol does not allow; it was reset")
                self.host.send({"op": "result", "id": request_id, "error": error})
                return

    @staticmethod
    def encoded_result(message: dict[str, Any], request_id: Any) -> bytes:
        try:
            return Channel.encode(result_of(message, request_id))
        except (ValueError, RecursionError) as exc:  # escaped again, a final value can outgrow a frame
            error = {"type": "ResultTooLarge", "message": f"the cell's result cannot be sent: {exc}"}
            return Channel.encode({"op": "result", "id": request_id, "error": error})

    def send_to_child(self, message: dict[str, Any]) -> None:
        self.write_to_child(Channel.encode(message))

    def write_to_child(self, frame: bytes) -> None:
        """A child that is gone (a cell can end its own process) cannot take it: that is not our
        end. Its socket then reads as closed, and next_from_child says how the child ended."""
        assert self.child is not None
        with suppress(OSError):
            self.child.write(frame)

    def next_from_child(self) -> dict[str, Any] | str:
        """The child's next frame, or why there will be none (it died, or it was stopped)."""
        assert self.child is not None
        while True:
            ready, _, _ = select.select([self.child.fd_in], [], [], WATCH_SECONDS)
            if ready:
                message, refused = self.child.receive(), self.child.refused
                if message is None and refused:
                    return f"the cell sent {refused}, which the REPL protocol does not allow; it was reset"
                if message is None:
                    return f"the REPL process {end_child(self.child_pid)}; its state was reset"
                return message
            if process_state(self.child_pid) in ("T", "t"):
                return STOPPED

    def replace_child(self) -> None:
        end_child(self.child_pid)
        if self.child is not None:
            os.close(self.child.fd_in)  # its only fd, both ways
            self.child = None
        kill_leftovers(keep=0)
        self.start_child()


def encoded_call(message: dict[str, Any]) -> bytes | None:
    """The child's tool call for the host, rebuilt from its name and arguments; None for one the
    protocol does not allow: malformed, or (written by the cell past the interpreter's own
    encoder, which refuses it) too large for a frame once escaped to ASCII again."""
    name, kwargs = message.get("name"), message.get("kwargs")
    if not (isinstance(name, str) and isinstance(kwargs, dict)):
        return None
    try:
        return Channel.encode({"op": "tool_call", "name": name, "kwargs": kwargs})
    except (ValueError, RecursionError):
        return None


def result_of(message: dict[str, Any], request_id: Any) -> dict[str, Any]:
    """The child's result, rebuilt from the fields the protocol has: nothing else passes."""
    reply: dict[str, Any] = {"op": "result", "id": request_id}
    final, error, killed = message.get("final"), message.get("error"), message.get("killed")
    if isinstance(final, dict):
        reply["final"] = final
    if isinstance(killed, list):
        reply["killed"] = [pid for pid in killed[:MAX_KILLED] if type(pid) is int]
    if isinstance(error, dict):
        reply["error"] = {key: str(error.get(key, "")) for key in ("type", "message", "traceback")}
    return reply


def problem(message: str) -> dict[str, str]:
    return {"type": "ReplReset", "message": message, "traceback": ""}


def end_child(pid: int) -> str:
    """Reap the child (killing it if it lingers after closing its channel); how it ended."""
    status = None
    for _ in range(20):
        try:
            reaped, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return "is gone"
        if reaped:
            break
        select.select([], [], [], 0.05)
    else:
        with suppress(ProcessLookupError):
            os.kill(pid, _signal.SIGKILL)
        with suppress(ChildProcessError):
            os.waitpid(pid, 0)
        return "closed its channel and was killed"
    assert status is not None
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        hint = " (out of memory, or killed)" if number == _signal.SIGKILL else ""
        return f"died by signal {signal_name(number)}{hint}"
    return f"exited with status {os.WEXITSTATUS(status)}"


def signal_name(number: int) -> str:
    import signal  # its enum of names only for a death, which is rare

    try:
        return signal.Signals(number).name
    except ValueError:  # real-time signals have no name of their own
        return str(number)


def signal_child(pid: int, number: int) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, number)


def process_state(pid: int, tid: int | None = None) -> str:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path, "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return "?"


class Census:
    """Whether the stopped interpreter is alone with the supervisor: three reads of /proc files
    kept open (a pread each), where a scan of /proc costs far more a cell (ADR 0031).

    Every process of the sandbox but the supervisor descends from it: from the interpreter, or
    reparented to the supervisor (the subreaper) when its parent ended. So with the interpreter
    stopped (it cannot fork, and the seccomp filter leaves it no way to have itself continued:
    syscalls.py), one thread in it, no child of that thread, and the interpreter the
    supervisor's only child, no other process exists. The interpreter's children are read first:
    a process moves from its side to the supervisor's (when its parent ends), never back, so no
    process can slip past both reads. Anything else (a thread or a zombie left by the cell, a
    file that cannot be read) answers False, and kill_leftovers scans the whole of /proc."""

    def __init__(self, child: int) -> None:
        self.expected = f"{child} ".encode()  # the children file's format: "pid pid ... "
        self.stat = self.children = self.own = -1
        if child <= 0:
            return
        with suppress(OSError):
            self.own = os.open(f"/proc/self/task/{os.getpid()}/children", os.O_RDONLY)
            self.stat = os.open(f"/proc/{child}/stat", os.O_RDONLY)
            self.children = os.open(f"/proc/{child}/task/{child}/children", os.O_RDONLY)

    def alone(self) -> bool:
        if min(self.stat, self.children, self.own) < 0:
            return False
        try:
            fields = os.pread(self.stat, 1024, 0).rsplit(b")", 1)[1].split()
            if fields[0] != b"T" or fields[17] != b"1":  # its state, and num_threads (field 20)
                return False
            return not os.pread(self.children, 64, 0) and os.pread(self.own, 64, 0) == self.expected
        except (OSError, IndexError):  # the interpreter is gone, or /proc has no children files
            return False

    def close(self) -> None:
        for fd in (self.own, self.stat, self.children):
            if fd >= 0:
                with suppress(OSError):
                    os.close(fd)
        self.stat = self.children = self.own = -1


STOP_SPINS = 200  # waitid polls, a yield between them, before the wait sleeps instead
STOP_SLEEPS = 25  # 0.1 ms, doubling up to 50 ms: 0.85 s in all


def await_stop(pid: int) -> bool:
    """Until SIGSTOP has stopped every thread of the interpreter (True). kill(2) returns before
    that, and a thread inside fork(2) then still finishes it: the new process could miss the
    check that follows. False when the interpreter ended, or a thread of it cannot stop (it
    waits on a vforked child, say): the full scan then runs anyway, as it always did."""
    options = os.WSTOPPED | os.WEXITED | os.WNOWAIT | os.WNOHANG  # WNOWAIT: end_child reaps
    pause = 0.0001
    for attempt in range(STOP_SPINS + STOP_SLEEPS):
        try:
            info = os.waitid(os.P_PID, pid, options)
        except ChildProcessError:
            return False
        if info is not None:
            return info.si_code == os.CLD_STOPPED
        if attempt < STOP_SPINS:
            os.sched_yield()  # the interpreter may be waiting for this CPU to reach its stop
        else:
            select.select([], [], [], pause)
            pause = min(pause * 2, 0.05)
    return False


KILL_PASSES = 100


def kill_leftovers(keep: int) -> None:
    """SIGKILL every descendant of the supervisor but the interpreter `keep`: what a cell started
    in the background never outlives the cell. The supervisor is a child subreaper, so even a
    double-forked daemon stays its descendant. Passes repeat until none is left alive: a process
    that forked between a scan and its kill leaves a child the next pass finds."""
    for _ in range(KILL_PASSES):
        with suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        if not others_than(keep):
            return
        alive = {pid for pid in descendants(os.getpid()) - {keep} if runs(pid)}
        if not alive:
            return
        for pid in alive:
            with suppress(OSError):
                os.kill(pid, _signal.SIGKILL)


def runs(pid: int) -> bool:
    """Whether any thread of the process still runs. A zombie's other threads can: a process
    whose main thread called exit(2) reads `Z` while the rest of it carries on."""
    state = process_state(pid)
    if state not in ("Z", "X"):
        return state != "?"
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    return any(process_state(pid, int(tid)) not in ("Z", "X", "?") for tid in tasks if tid.isdigit())


def others_than(keep: int) -> bool:
    """Whether /proc lists a process besides pid 1, this one and `keep`. Only such a process can
    be a leftover, so the common cell (the jail's pid namespace holds just the supervisor and
    the interpreter) costs one directory read instead of a stat of every process."""
    try:
        listed = os.listdir("/proc")
    except OSError:
        return True  # cannot tell: do the full scan
    usual = {"1", str(os.getpid()), str(keep)}
    return any(entry.isdigit() and entry not in usual for entry in listed)


def descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    with suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with (
                    suppress(OSError, IndexError, ValueError),
                    open(f"/proc/{entry}/stat", "rb") as stat,
                ):
                    parents[int(entry)] = int(stat.read().rsplit(b")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


LIBC_PRCTL: Any = None  # prctl's function pointer, once looked up


def prctl(option: int, value: int) -> None:
    """prctl(2) through `_ctypes`, the C half of ctypes: `import ctypes` costs more CPU at every
    REPL start (ADR 0019) for a type layer this one call does not need. The function is looked
    up once per process."""
    global LIBC_PRCTL  # noqa: PLW0603
    if LIBC_PRCTL is None:
        LIBC_PRCTL = libc_prctl()
    if LIBC_PRCTL(option, value, 0, 0, 0) != 0:
        import _ctypes

        raise OSError(_ctypes.get_errno(), "prctl failed")


def libc_prctl() -> Any:
    """The C library's prctl as a callable, as ctypes.CDLL(None, use_errno=True).prctl is."""
    import _ctypes

    # The ignores: typeshed describes these through ctypes' own classes, which are not loaded.
    class CInt(_ctypes._SimpleCData):  # type: ignore[type-arg]  # ctypes.c_int
        _type_ = "i"

    class LibcFunction(_ctypes.CFuncPtr):  # a function of CDLL(None, use_errno=True)
        _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
        _restype_ = CInt

    class Libc:  # what CFuncPtr reads from a ctypes.CDLL: the dlopen handle
        _handle = _ctypes.dlopen(None)  # type: ignore[arg-type]  # None: the program itself

    return LibcFunction(("prctl", Libc()))  # type: ignore[arg-type]


def fatal(reason: str) -> NoReturn:
    """The protocol is broken beyond repair: say why on stderr and die (the host sees EOF)."""
    os.write(2, f"repl_main: {reason}\n".encode())
    os._exit(3)


def apply_limits(memory_mb: int, max_processes: int, max_file_mb: int) -> None:
    """Cap address space, processes and file size for this process and everything it starts."""
    # Oversized writes must fail with EFBIG in the cell, not kill the REPL with SIGXFSZ.
    _signal.signal(_signal.SIGXFSZ, _signal.SIG_IGN)
    for limit, value in (
        (resource.RLIMIT_AS, memory_mb * 1024 * 1024),
        (resource.RLIMIT_FSIZE, max_file_mb * 1024 * 1024),
    ):
        if value > 0:
            lower(limit, value)
    if max_processes > 0:
        # Best effort: some hosts refuse it; the sandbox's pid namespace still bounds the tree.
        with suppress(OSError, ValueError):
            lower(resource.RLIMIT_NPROC, max_processes)


def lower(limit: int, value: int) -> None:
    """Set both soft and hard limit to `value`, never above the existing hard limit."""
    _soft, hard = resource.getrlimit(limit)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(limit, (value, value))


def parse_args(argv: list[str]) -> dict[str, int]:
    options = {"--memory-mb": 0, "--max-processes": 0, "--max-file-mb": 0, "--output-fd": -1}
    for flag, value in zip(argv[::2], argv[1::2], strict=False):
        if flag in options:
            options[flag] = int(value)
    return options


def text_option(argv: list[str], flag: str) -> str:
    """The value of a text option (`--site`, `--preload`), or ""."""
    for name, value in zip(argv[::2], argv[1::2], strict=False):
        if name == flag:
            return value
    return ""


def preload(modules: str) -> None:
    """Import what the profile names (sandbox.python.preload), before the first cell reads its
    request: a module that fails (or exits) is left for the cell that imports it to report, and
    nothing an import prints reaches the first cell's output (Stdio.restore puts fds 1 and 2
    back before it)."""
    if not modules:
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    for name in modules.split(","):
        if name:
            with suppress(BaseException):
                __import__(name)
    for stream in (sys.stdout, sys.stderr):  # what they buffered goes to /dev/null too
        with suppress(BaseException):
            stream.flush()


def main() -> int:
    options = parse_args(sys.argv[1:])
    output_fd = options["--output-fd"]
    if output_fd < 0:
        fatal("no --output-fd")
    # The host channel moves to fds no one expects; fd 0 becomes /dev/null, fd 1 the output pipe.
    frame_in, frame_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(output_fd, 1)
    try:
        prctl(PR_SET_DUMPABLE, 0)  # /proc/<this pid>/fd is closed to every other process
        prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of a cell become ours, to be killed
    except Exception as exc:  # OSError, or a _ctypes that changed: never run unsecured
        fatal(f"cannot secure the supervisor: {type(exc).__name__}: {exc}")
    apply_limits(options["--memory-mb"], options["--max-processes"], options["--max-file-mb"])
    site = text_option(sys.argv[1:], "--site")
    if site:  # the sandbox's packages (read-only): -S added no site-packages of the host's
        sys.path.append(site)
    host = Channel(frame_in, frame_out)
    supervisor = Supervisor(host, output_fd, text_option(sys.argv[1:], "--preload"))
    supervisor.start_child()
    host.send({"op": "ready", "pid": os.getpid(), "python": sys.version.split()[0]})
    supervisor.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
