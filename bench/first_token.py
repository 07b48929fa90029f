"""Lane `first-token`: from a Turn's POST to the first `reasoning-delta` with content, on the
provider path, against the streaming fake provider (tests/support/fake_provider.py, on loopback)
with a realistic time to first token and token rate; the baseline is the provider's own time to
first token, a streamed request straight to it, measured in the same rounds (ABBA)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from bench import stack as fleet_stack
from bench.harness import Receipt, goal, interleave, summary
from tests.support.fake_provider import serve_fake_provider

TTFT_S, TOKENS_PER_S = 0.4, 60
REASONING = (
    "Read the request, then compute the answer in plain Python before submitting it, checking the "
    "arithmetic once more on the way."
)
REPLY = (
    f"[[ ## reasoning ## ]]\n{REASONING}\n\n[[ ## code ## ]]\nSUBMIT(answer=str(6 * 7))\n\n"
    "[[ ## completed ## ]]"
)
DELTA = b'"type":"reasoning-delta"'
REASONING_HEADER = "[[ ## reasoning ## ]]"


def config_text() -> str:
    """The bench profile with one provider LM (FLEET_LM_*) for root and sub."""
    lm = 'model_env = "FLEET_LM_MODEL"\napi_key_env = "FLEET_LM_API_KEY"\nbase_url_env = "FLEET_LM_BASE_URL"'
    template = fleet_stack.CONFIG_TEMPLATE.format(script="", concurrency=4, heartbeat_seconds=10)
    scripted = template.split("[profiles.bench.llm.root]")[0]
    rest = template.split("[profiles.bench.rlm]")[1]
    lms = f"[profiles.bench.llm.root]\n{lm}\n\n[profiles.bench.llm.sub]\n{lm}\n\n"
    return f"{scripted}{lms}[profiles.bench.rlm]{rest}"


def first_delta_s(port: int, session: str) -> float:
    """POST a Turn; seconds to the first reasoning-delta frame. The Turn is read to its end."""
    seen: list[float] = []

    def watch(raw: bytes) -> None:
        if not seen and DELTA in raw:
            seen.append(time.perf_counter())

    result = fleet_stack.post_turn(port, session, "What is 6 * 7?", on_data=watch)
    if not result.finished or not seen:
        raise RuntimeError(f"the Turn did not stream its reasoning: {result.raw[-600:]!r}")
    return seen[0] - result.started


def provider_times_s(port: int) -> tuple[float, float]:
    """A streamed request straight to the fake provider: its time to first token, and to the
    first character of the reasoning itself (after DSPy's `[[ ## reasoning ## ]]` header)."""
    body = json.dumps(
        {"model": "bench-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    )
    reasoning_at: list[float] = []

    def watch(raw: bytes) -> None:
        if reasoning_at:
            return
        frames = raw.split(b"\r\n\r\n", 1)[-1].split(b"\n\n")
        text = "".join(
            json.loads(frame[6:])["choices"][0]["delta"].get("content") or ""
            for frame in frames
            if frame.startswith(b"data: {")
        )
        if text.partition(REASONING_HEADER)[2].strip():
            reasoning_at.append(time.perf_counter())

    result = fleet_stack.read_stream(port, "POST", "/v1/chat/completions", body.encode(), on_data=watch)
    if result.first_frame_s is None or not reasoning_at:
        raise RuntimeError(f"the fake provider did not stream: {result.raw[:300]!r}")
    return result.first_frame_s, reasoning_at[0] - result.started


def run(*, quick: bool = False, repeats: int | None = None, warmup: int | None = None) -> dict[str, Any]:
    repeats = repeats if repeats is not None else (6 if quick else 40)
    warmup = warmup if warmup is not None else (1 if quick else 3)
    receipt = Receipt(
        "first-token",
        {"repeats": repeats, "warmup": warmup, "provider_ttft_s": TTFT_S,
         "provider_tokens_per_s": TOKENS_PER_S, "token": "4 characters",
         "reasoning_chars": len(REASONING), "workers": 1, "worker_concurrency": 4,
         "provider": "the streaming fake provider (tests/support/fake_provider.py) on loopback"},
        baseline="the provider's own time to first token: a streamed request straight to it, same rounds",
    )  # fmt: skip
    with serve_fake_provider() as provider:
        provider.ttft_s, provider.tokens_per_s = TTFT_S, TOKENS_PER_S
        provider.replies += [REPLY] * (4 * (warmup + repeats) + 8)
        port = int(provider.url.rsplit(":", 1)[1].split("/", 1)[0])
        env = {
            "FLEET_LM_MODEL": "openai/bench-model",
            "FLEET_LM_API_KEY": "sk-bench",
            "FLEET_LM_BASE_URL": provider.url,
        }
        with fleet_stack.stack(config_text=config_text(), extra_env=env) as st:
            st.start(workers=1)
            st.wait_workers_ready(1)
            session_for = fleet_stack.sessions_by_kind(st.url)

            def subject(kind: str) -> Callable[[], float]:
                return lambda: first_delta_s(st.port, session_for(kind))

            to_reasoning: list[float] = []

            def provider_ttft() -> float:
                ttft, reasoning = provider_times_s(port)
                to_reasoning.append(reasoning)
                return ttft

            samples = interleave(
                {
                    "same_session": subject("same_session"),
                    "new_session": subject("new_session"),
                    "provider_ttft": provider_ttft,
                },
                warmup=warmup,
                repeats=repeats,
            )
    ttft = summary(samples["provider_ttft"])
    reasoning = summary(to_reasoning[warmup:])
    figures = {kind: summary(samples[kind]) for kind in ("same_session", "new_session")}
    receipt.figures = {
        "first_delta_same_session": figures["same_session"],
        "first_delta_new_session": figures["new_session"],
        "provider_ttft": ttft,
        "provider_first_reasoning_char": reasoning,
        "over_provider_ttft_p50_ms": {
            kind: round(figures[kind]["p50_ms"] - ttft["p50_ms"], 3)
            for kind in ("same_session", "new_session")
        },
        "over_provider_first_reasoning_char_p50_ms": {
            kind: round(figures[kind]["p50_ms"] - reasoning["p50_ms"], 3)
            for kind in ("same_session", "new_session")
        },
    }
    for kind in ("same_session", "new_session"):
        limit = round(ttft["p50_ms"] + 25, 3)
        measured = figures[kind]["p50_ms"]
        receipt.goals.append(
            goal(f"first_token_{kind}", "p50 ≤ provider TTFT + 25 ms",
                 {"p50_ms": measured, "limit_ms": limit}, measured <= limit)
        )  # fmt: skip
    receipt.notes.append(
        "The reasoning's first character reaches the provider's stream only after DSPy's field header "
        f"({REASONING_HEADER!r} and a newline: about 6 tokens of 4 characters, ~100 ms at this token "
        "rate), and DSPy's StreamListener holds a few characters back to tell the field's end from its "
        "text: provider_first_reasoning_char is the provider's own time to that character, and "
        "over_provider_first_reasoning_char what fleet adds to it."
    )
    receipt.notes.append(
        "first_delta: from just before the POST is written on a raw socket to the frame that carries "
        "the first reasoning-delta; it includes the claim, the queue, the lease and the Turn's "
        "setup before its first LM call, then the provider's own time to first token. same_session: "
        "one running conversation (a warm REPL waits); new_session: each sample a session's first Turn."
    )
    return receipt.written()
