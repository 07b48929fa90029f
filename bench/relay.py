"""The fan-out lane's second baseline: a minimal FastAPI + sse-starlette relay, served by uvicorn
in one process, the way a small Redis-to-SSE bridge is commonly written.

`GET /runs/{run_id}/stream` subscribes its own redis-py pub/sub connection to the events channel,
decodes each message, forwards the Run's events as `data: <json>` frames and ends with
`data: [DONE]` after the Run's terminal event. No replay, no resume, no heartbeats of its own
(sse-starlette's pings aside): it does less than the gateway, which makes it a fair floor.

Run: `python -m bench.relay --port P --redis URL --channel CHANNEL` (loopback only).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from bench.harness import baseline_args, start_baseline_module

TERMINAL = {"run.completed", "run.failed", "run.cancelled"}


def build_app(redis_url: str, channel: str) -> Any:
    from fastapi import FastAPI
    from redis.asyncio import Redis
    from sse_starlette.sse import EventSourceResponse

    app = FastAPI()
    redis = Redis.from_url(redis_url)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/runs/{run_id}/stream")
    async def stream(run_id: str) -> EventSourceResponse:
        async def frames() -> AsyncIterator[str]:
            pubsub = redis.pubsub(ignore_subscribe_messages=True)
            await pubsub.subscribe(channel)
            try:
                yield json.dumps({"type": "start", "messageId": run_id})
                async for message in pubsub.listen():
                    event = json.loads(message["data"])
                    if event.get("run_id") != run_id:
                        continue
                    yield json.dumps(event)
                    if event.get("type") in TERMINAL:
                        yield "[DONE]"
                        return
            finally:
                await pubsub.aclose()

        return EventSourceResponse(frames())

    return app


def available() -> str | None:
    """None when the relay can run here, else why not."""
    try:
        import fastapi  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        return f"the relay baseline needs the `bench` dependency group ({exc.name} is missing)"
    return None


def start(redis_url: str, channel: str, port: int, cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    """The relay in its own process group, once it answers on `port`."""
    return start_baseline_module("relay", "bench.relay", port, cwd, log, redis=redis_url, channel=channel)


def main() -> int:
    import uvicorn

    args = baseline_args("bench.relay", "redis", "channel")
    uvicorn.run(
        build_app(args.redis, args.channel),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        backlog=2048,
        limit_concurrency=None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
