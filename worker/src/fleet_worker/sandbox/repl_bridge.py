"""The REPL's frames over a text channel, for sandboxes reached only through a command's stdin and
stdout (Daytona's session commands). Stdlib only; it runs inside the remote sandbox next to
`repl_main.py`, which it starts.

Each line on stdin is base64 of bytes for the REPL's frame channel (chunked as the host likes).
Each line on stdout is `F <base64>` (bytes of frames from the REPL) or `O <base64>` (bytes of the
cells' output). Base64 keeps the channel ASCII, whatever the transport does to text.
"""

from __future__ import annotations

import base64
import os
import select
import subprocess
import sys
import threading

CHUNK = 48 * 1024
PIPE_MAX_BYTES = 1024 * 1024  # the largest pipe buffer an unprivileged process can ask for


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    read_output, write_output = os.pipe()
    repl = subprocess.Popen(
        [
            sys.executable,
            "-I",
            "-S",
            os.path.join(here, "repl_main.py"),
            "--output-fd",
            str(write_output),
            *sys.argv[1:],
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        pass_fds=(write_output,),
        bufsize=0,
    )
    os.close(write_output)

    def emit(kind: bytes, data: bytes) -> None:
        sys.stdout.buffer.write(kind + b" " + base64.b64encode(data) + b"\n")
        sys.stdout.buffer.flush()

    def pump(frames: int, output: int) -> None:
        """Frames and output on one stream, in the order the REPL wrote them: a cell's output is
        in its pipe before its result frame exists, so frame bytes, once read, wait for what the
        output pipe holds then to go first (the host reads a result, then the output it holds)."""
        open_fds = [frames, output]
        while open_fds:
            ready, _, _ = select.select(open_fds, [], [])
            if frames not in ready:
                forward_output(output, open_fds)
                continue
            data = os.read(frames, CHUNK)
            # At most what a pipe can hold: output that never stops must not starve frames.
            budget = PIPE_MAX_BYTES
            while budget > 0 and output in open_fds and select.select([output], [], [], 0)[0]:
                budget -= forward_output(output, open_fds)
            if data:
                emit(b"F", data)
            else:
                open_fds.remove(frames)

    def forward_output(fd: int, open_fds: list[int]) -> int:
        data = os.read(fd, CHUNK)
        if data:
            emit(b"O", data)
        else:
            open_fds.remove(fd)
        return max(len(data), 1)

    assert repl.stdout is not None and repl.stdin is not None
    stdin = repl.stdin

    def feed() -> None:
        try:
            for raw in sys.stdin.buffer:
                line = raw.strip()
                if line:
                    stdin.write(base64.b64decode(line, validate=True))
        except (OSError, ValueError):
            pass  # the REPL is gone, or the host sent garbage: the REPL ends, the host sees it
        finally:
            stdin.close()

    pumping = threading.Thread(target=pump, args=(repl.stdout.fileno(), read_output), daemon=True)
    pumping.start()
    threading.Thread(target=feed, daemon=True).start()
    code = repl.wait()  # stdin may never close (a session command's): end with the REPL
    pumping.join(timeout=2)
    return code


if __name__ == "__main__":
    sys.exit(main())
