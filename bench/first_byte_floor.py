"""The first byte's floor on this machine, for lane `turn`: what any durable Turn POST must do
before its first byte, on fleet's own server stack, without fleet.

`POST /turns` commits one row to SQLite (a file in WAL mode with SQLite's default, fsyncing
`synchronous`, as fleet's embedded profile does) in a thread, makes one Redis round trip (a SET
through redis-py's asyncio client) and answers with a one-frame SSE Stream. It is a Litestar app
on Granian, like the gateway: the gap between fleet's first byte and this one is fleet's own
work (validation, the claim's read and second INSERT, the enqueue script, the stream's set-up),
and what remains of this one is the machine's (HTTP, a thread hop, an fsync, a loopback round
trip, each event-loop wake-up).

Run: `python -m bench.first_byte_floor --port P --redis URL --db PATH` (loopback only).
"""

import asyncio
import os
import sqlite3
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from bench.harness import baseline_args, start_baseline_module

FRAME = b'data: {"type":"start"}\n\n'


def build_app() -> Any:
    """The app factory Granian calls in its worker; its settings come from the env."""
    from litestar import Litestar, get, post
    from litestar.response import Stream
    from redis.asyncio import Redis

    redis = Redis.from_url(os.environ["FLEET_BENCH_FLOOR_REDIS"])
    connection = sqlite3.connect(os.environ["FLEET_BENCH_FLOOR_DB"], check_same_thread=False)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("CREATE TABLE IF NOT EXISTS turns (id TEXT PRIMARY KEY, body TEXT NOT NULL)")
    lock = threading.Lock()  # one connection, used from the default executor's threads

    def commit(turn_id: str, body: str) -> None:
        with lock:
            connection.execute("INSERT INTO turns (id, body) VALUES (?, ?)", (turn_id, body))
            connection.commit()

    async def one_frame() -> AsyncIterator[bytes]:
        yield FRAME

    @get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @post("/turns", status_code=200)
    async def turn(data: dict[str, Any]) -> Stream:
        turn_id = str(uuid.uuid4())
        body = str(data.get("text", ""))
        await asyncio.to_thread(commit, turn_id, body)
        await redis.set(f"floor:{turn_id}", body, px=60_000)
        return Stream(one_frame(), media_type="text/event-stream")

    return Litestar([health, turn], openapi_config=None)


def start(redis_url: str, db: Path, port: int, cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    """The floor app in its own process group, once it answers on `port`."""
    return start_baseline_module(
        "first-byte floor app", "bench.first_byte_floor", port, cwd, log, redis=redis_url, db=str(db)
    )


def main() -> int:
    from granian import Granian

    args = baseline_args("bench.first_byte_floor", "redis", "db")
    os.environ["FLEET_BENCH_FLOOR_REDIS"], os.environ["FLEET_BENCH_FLOOR_DB"] = args.redis, args.db
    # As `fleet gateway` runs the gateway: one worker process, Granian's default loop (uvloop).
    Granian("bench.first_byte_floor:build_app", address="127.0.0.1", port=args.port, interface="asgi",  # type: ignore[arg-type]
            factory=True, workers=1, backlog=2048, log_access=False).serve()  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
