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
import subprocess
import sys
import threading

CHUNK = 48 * 1024


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
    lock = threading.Lock()

    def emit(kind: bytes, fd: int) -> None:
        while data := os.read(fd, CHUNK):
            line = kind + b" " + base64.b64encode(data) + b"\n"
            with lock:
                sys.stdout.buffer.write(line)
                sys.stdout.buffer.flush()

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

    threads = [
        threading.Thread(target=emit, args=(b"F", repl.stdout.fileno()), daemon=True),
        threading.Thread(target=emit, args=(b"O", read_output), daemon=True),
    ]
    for thread in threads:
        thread.start()
    threading.Thread(target=feed, daemon=True).start()
    code = repl.wait()  # stdin may never close (a session command's): end with the REPL
    for thread in threads:
        thread.join(timeout=2)
    return code


if __name__ == "__main__":
    sys.exit(main())
