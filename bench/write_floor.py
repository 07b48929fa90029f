"""The fan-out lane's write floor: the CPU one process spends to hand a small frame to each of N
loopback TCP connections, one `send` per connection per event, with the lane's gap between events.

Any server that writes every event to every stream pays at least this per delivery; on loopback
the kernel also runs the receiving side of TCP in the sender's system call, so the figure counts
that too, as the gateway's CPU does. Only the sender's own CPU is counted (`time.process_time`);
a forked child drains the connections.

`python -m bench.write_floor --streams N --events E --interval S --size B` prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import time

# A bench event's SSE frame as the gateway writes it: 138 bytes, and HTTP/1.1 chunk framing.
FRAME_BYTES = 144


def drain(listener: socket.socket, streams: int, expected: int) -> None:
    """The receiving child: accept every connection and read until all bytes arrived."""
    selector = selectors.DefaultSelector()
    for _ in range(streams):
        conn, _ = listener.accept()
        selector.register(conn, selectors.EVENT_READ)
    received = 0
    while received < expected:
        for key, _ in selector.select(timeout=30):
            chunk = key.fileobj.recv(1 << 16)  # type: ignore[union-attr]
            if not chunk:
                return
            received += len(chunk)


def measure(streams: int, events: int, interval: float, size: int) -> dict[str, float]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(streams)
    port = listener.getsockname()[1]
    child = os.fork()
    if child == 0:
        try:
            drain(listener, streams, streams * events * size)
        finally:
            os._exit(0)
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
    frame = b"x" * size
    try:
        started = time.process_time()
        for _ in range(events):
            for conn in conns:
                conn.sendall(frame)
            time.sleep(interval)
        cpu = time.process_time() - started
    finally:
        for conn in conns:
            conn.close()
        os.waitpid(child, 0)
    return {"cpu_us_per_send": round(cpu / (streams * events) * 1e6, 3), "frame_bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, required=True)
    parser.add_argument("--events", type=int, required=True)
    parser.add_argument("--interval", type=float, required=True)
    parser.add_argument("--size", type=int, default=FRAME_BYTES)
    args = parser.parse_args()
    print(json.dumps(measure(args.streams, args.events, args.interval, args.size)))


if __name__ == "__main__":
    main()
