"""The fan-out lane's server floor: the least an ASGI app on Granian does to hand a Redis event to
N SSE streams, without fleet and without Litestar.

One redis-py pub/sub connection per process, decoded once per event with msgspec; each stream is
a bare ASGI handler that sleeps on a future of its own and, once woken, sends what is queued for
it as one `http.response.body` message, ending with `data: [DONE]` after the Run's terminal
event. No framework, no projection, no resume, no heartbeats: per delivery it pays for one
wake-up of a task and one ASGI send, which any ASGI server on this machine pays too. The gap
between the gateway's CPU per delivery and this one's is fleet's own (and Litestar's); the gap
between this one's and the bare write floor (`bench/write_floor.py`) is the server stack's.

It runs as `fleet gateway` runs the gateway: Granian, one worker process, its default loop,
backlog 2048 and room for every stream. Loopback only.

Run: `python -m bench.fanout_floor --port P --redis URL --channel CHANNEL`.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.harness import baseline_args, start_baseline_module

TERMINAL = (b'"run.completed"', b'"run.failed"', b'"run.cancelled"')
HEALTH = b'{"status":"ok"}'
START = b'data: {"type":"start"}\n\n'


class Waiting:
    """One stream: what is queued for it, and the future it sleeps on."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: list[bytes] = []
        self.waiter: asyncio.Future[None] | None = None


def build_app() -> Any:
    """The ASGI callable Granian calls in its worker; its settings come from the env."""
    return FloorApp(os.environ["FLEET_BENCH_FLOOR_REDIS"], os.environ["FLEET_BENCH_FLOOR_CHANNEL"])


class FloorApp:
    def __init__(self, redis_url: str, channel: str) -> None:
        import msgspec
        from redis.asyncio import Redis

        class Header(msgspec.Struct):
            run_id: str = ""

        self.redis = Redis.from_url(redis_url)
        self.channel = channel
        self.decode = msgspec.json.Decoder(Header).decode
        self.streams: dict[str, set[Waiting]] = defaultdict(set)
        self.tasks: set[asyncio.Task[None]] = set()

    async def listen(self) -> None:
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self.channel)
        async for message in pubsub.listen():
            data = message["data"]
            for stream in self.streams.get(self.decode(data).run_id, ()):
                stream.items.append(data)
                waiter = stream.waiter
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    listener = asyncio.get_running_loop().create_task(self.listen())
                    listener.add_done_callback(listener_ended)
                    self.tasks.add(listener)
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})  # fmt: skip
            await send({"type": "http.response.body", "body": HEALTH})
            return
        run_id = scope["path"].split("/")[2]  # /runs/<run id>/stream
        stream = Waiting()
        self.streams[run_id].add(stream)
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
            await send({"type": "http.response.body", "body": START, "more_body": True})
            await self.follow(stream, send)
        finally:
            self.streams[run_id].discard(stream)

    async def follow(self, stream: Waiting, send: Any) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not stream.items:
                stream.waiter = loop.create_future()
                await stream.waiter
                stream.waiter = None
            items, stream.items = stream.items, []
            body = b"".join(b"data: %s\n\n" % data for data in items)
            ended = any(mark in items[-1] for mark in TERMINAL)
            if ended:
                body += b"data: [DONE]\n\n"
            await send({"type": "http.response.body", "body": body, "more_body": not ended})
            if ended:
                return


def listener_ended(task: asyncio.Task[None]) -> None:
    """A floor that no longer hears Redis would hang the lane's receivers: say why, and exit."""
    if not task.cancelled() and task.exception() is not None:
        os.write(2, f"fanout_floor: the pub/sub listener failed: {task.exception()!r}\n".encode())
        os._exit(1)


def start(redis_url: str, channel: str, port: int, cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    """The floor server in its own process group, once it answers on `port`."""
    return start_baseline_module(
        "fan-out floor server", "bench.fanout_floor", port, cwd, log, redis=redis_url, channel=channel
    )


def main() -> int:
    from granian import Granian

    args = baseline_args("bench.fanout_floor", "redis", "channel")
    os.environ["FLEET_BENCH_FLOOR_REDIS"], os.environ["FLEET_BENCH_FLOOR_CHANNEL"] = args.redis, args.channel
    # As `fleet gateway` runs the gateway: one worker, Granian's default loop, room for every stream.
    Granian("bench.fanout_floor:build_app", address="127.0.0.1", port=args.port, interface="asgi",  # type: ignore[arg-type]
            factory=True, workers=1, backlog=2048, backpressure=16_384, log_access=False).serve()  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
