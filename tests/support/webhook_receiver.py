"""A webhook receiver on loopback (a real HTTP server in a thread) that records every request and
answers as the test says: a status per request, in order (then 200), or a delay first."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    statuses: list[int] = field(default_factory=list)  # answered in order; 200 once they run out
    hold_first_seconds: float = 0.0  # the first request waits this long before its answer
    received: list[Received] = field(default_factory=list)
    arrived: threading.Condition = field(default_factory=threading.Condition)
    url: str = ""

    def wait_for(self, count: int, timeout: float = 60) -> list[Received]:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.received) >= count, timeout), self.received
            return list(self.received)


@contextmanager
def serve_receiver(receiver: Receiver) -> Iterator[Receiver]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            with receiver.arrived:
                number = len(receiver.received)
                receiver.received.append(Received({k.lower(): v for k, v in self.headers.items()}, body))
                receiver.arrived.notify_all()
            if number == 0 and receiver.hold_first_seconds:
                time.sleep(receiver.hold_first_seconds)
            status = receiver.statuses[number] if number < len(receiver.statuses) else 200
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}/hooks/fleet"
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
