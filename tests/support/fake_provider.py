"""A loopback OpenAI-compatible chat-completions server: the only stand-in on the LM provider
path. No provider is reachable in CI, so this fake replaces the provider at its narrowest
boundary (HTTP); everything from the config file to DSPy's and LiteLLM's own HTTP client is real.
It answers with queued replies, or with an OpenAI-style error body for a queued status."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class FakeProvider:
    replies: list[str]
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    url: str = ""
    status: int = 200  # anything else answers with an OpenAI-style error body
    statuses: list[int] = field(default_factory=list)  # per request, before `status` applies
    delay_s: float = 0.0  # a slow provider
    # A streamed reply (the request's `stream: true`): its first token after `ttft_s`, then
    # `tokens_per_s` tokens a second (0: all at once). A token is up to 4 characters.
    ttft_s: float = 0.0
    tokens_per_s: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # time.monotonic() of each chunk sent
    api_key: str | None = None  # when set, GET /models refuses (401) any other bearer token
    # A reply chosen from the request's body (None: the next of `replies`), for a test whose
    # replies depend on what each call carries (the instructions a Turn ran with, say).
    reply_for: Callable[[dict[str, Any]], str | None] | None = None


def chunk(model: str, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


@contextmanager
def serve_fake_provider() -> Iterator[FakeProvider]:
    """A fake provider on a free loopback port, for the `with` block."""
    fake = FakeProvider(replies=[])

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            fake.requests.append({"path": self.path, **body})
            fake.headers.append({k.lower(): v for k, v in self.headers.items()})
            status = fake.statuses.pop(0) if fake.statuses else fake.status
            if fake.delay_s:
                time.sleep(fake.delay_s)
            if status != 200:
                message = "Incorrect API key sk-boundary-test-key; set OPENAI_API_KEY (operator hint)"
                error = {"error": {"message": message, "type": "invalid_request_error"}}
                self.reply(status, json.dumps(error).encode())
                return
            chosen = fake.reply_for(body) if fake.reply_for is not None else None
            text = chosen if chosen is not None else fake.replies.pop(0) if fake.replies else "out of replies"
            if body.get("stream"):
                self.stream(body.get("model", ""), text)
                return
            payload = json.dumps(
                {
                    "id": "chatcmpl-test",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body.get("model", ""),
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
                }
            ).encode()
            self.reply(200, payload)

        def do_GET(self) -> None:
            """The model list (`fleet doctor`'s key check); a refusal echoes the key it got, as
            real providers do, so a test can see that nobody prints the body."""
            fake.headers.append({k.lower(): v for k, v in self.headers.items()})
            sent = self.headers.get("authorization", "").removeprefix("Bearer ")
            if self.path.rstrip("/").rsplit("/", 1)[-1] != "models":
                self.reply(404, b'{"error": {"message": "not found"}}')
            elif fake.api_key is not None and sent != fake.api_key:
                error = {
                    "error": {"message": f"Incorrect API key provided: {sent}", "type": "invalid_api_key"}
                }
                self.reply(401, json.dumps(error).encode())
            else:
                self.reply(
                    fake.status, json.dumps({"object": "list", "data": [{"id": "fake-model"}]}).encode()
                )

        def stream(self, model: str, text: str) -> None:
            """`chat.completion.chunk` events over SSE, as OpenAI streams, usage in the last."""
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            tokens = [text[i : i + 4] for i in range(0, len(text), 4)]
            time.sleep(fake.ttft_s)
            for index, token in enumerate(tokens):
                if index and fake.tokens_per_s:
                    time.sleep(1 / fake.tokens_per_s)
                self.event(chunk(model, {"content": token}, None))
            last = chunk(model, {}, "stop")
            last["usage"] = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
            self.event(last)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

        def event(self, payload: dict[str, Any]) -> None:
            self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
            self.wfile.flush()
            fake.chunk_times.append(time.monotonic())

        def reply(self, status: int, payload: bytes) -> None:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *_args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    fake.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
