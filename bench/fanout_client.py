"""The fan-out lane's receivers, each in its own process: `streams` SSE connections to one Run on
the gateway (or the relay baseline's `--path`), or (`--raw`) one redis-py pub/sub subscriber on
the events channel.

Each published event carries `bench:<index>:<monotonic ns>:`; CLOCK_MONOTONIC is one clock for
every process on the machine, so a receiver's latency is its own `monotonic_ns()` minus that.
Prints `ready <held>` once its connections are up, then writes its samples as JSON to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import sys
import time

MARK = re.compile(rb"bench:(\d+):(\d+):")
DONE = b"data: [DONE]"


class Receiver:
    def __init__(self, events: int) -> None:
        self.events = events
        self.latencies: list[float] = []
        self.duplicates = 0

    def scan(self, data: bytes, seen: set[int]) -> None:
        now = time.monotonic_ns()
        for match in MARK.finditer(data):
            index = int(match[1])
            if index in seen:
                continue
            seen.add(index)
            self.latencies.append((now - int(match[2])) / 1e9)


async def one_stream(
    port: int, path: str, receiver: Receiver, held: asyncio.Queue[bool], done: list[int]
) -> None:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        await held.put(False)
        return
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    writer.write(request.encode())
    seen: set[int] = set()
    tail = b""
    announced = False
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            if not announced and b"data: " in tail + data:
                announced = True
                await held.put(True)
            window = tail + data
            receiver.scan(window, seen)
            if DONE in window:
                done.append(1)
                break
            tail = window[-80:]
    except OSError:
        pass
    finally:
        if not announced:
            await held.put(False)
        writer.close()


async def streams_main(args: argparse.Namespace) -> dict[str, object]:
    receiver = Receiver(args.events)
    held: asyncio.Queue[bool] = asyncio.Queue()
    done: list[int] = []
    tasks = []
    for _ in range(args.streams):
        tasks.append(
            asyncio.create_task(
                one_stream(args.port, args.path or f"/api/runs/{args.run}/stream", receiver, held, done)
            )
        )
        await asyncio.sleep(0)  # let connects interleave rather than flood the accept queue at once
    live = 0
    deadline = time.monotonic() + args.hold_seconds
    for _ in range(args.streams):
        try:
            ok = await asyncio.wait_for(held.get(), timeout=max(0.01, deadline - time.monotonic()))
        except TimeoutError:
            break
        live += ok
    print(f"ready {live}", flush=True)
    await asyncio.wait(tasks, timeout=args.finish_seconds)
    for task in tasks:
        task.cancel()
    return {"held": live, "completed": len(done), "latencies": receiver.latencies}


async def raw_main(args: argparse.Namespace) -> dict[str, object]:
    from redis.asyncio import Redis

    redis = Redis.from_url(args.redis)
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(args.channel)
    receiver = Receiver(args.events)
    seen: set[int] = set()
    print("ready 1", flush=True)
    deadline = time.monotonic() + args.finish_seconds
    completed = 0
    while time.monotonic() < deadline:
        message = await pubsub.get_message(timeout=1.0)
        if message is None or message.get("type") != "message":
            continue
        data = message["data"]
        receiver.scan(data, seen)
        if b'"run.completed"' in data:
            completed = 1
            break
    await pubsub.aclose()
    await redis.aclose()
    return {"held": 1, "completed": completed, "latencies": receiver.latencies}


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench.fanout_client")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--run", default="")
    parser.add_argument("--path", default="", help="the stream's path (default: the gateway's for --run)")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--events", type=int, required=True)
    parser.add_argument("--hold-seconds", type=float, default=20)
    parser.add_argument("--finish-seconds", type=float, default=60)
    parser.add_argument("--raw", action="store_true")
    parser.add_argument("--redis", default="")
    parser.add_argument("--channel", default="")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    result = asyncio.run(raw_main(args) if args.raw else streams_main(args))
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
