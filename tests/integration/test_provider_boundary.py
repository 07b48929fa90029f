"""The real provider path (profile `local`: any OpenAI-compatible endpoint via FLEET_LM_*).

No provider is reachable here, so the narrowest fake stands in: a tiny OpenAI-compatible HTTP
server on 127.0.0.1. Everything from the config file to DSPy's own HTTP client is real.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from fleet_shared.config import load_settings
from fleet_worker import dspy_adapter
from tests.support.fake_provider import FakeProvider, serve_fake_provider

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-boundary-test-key"


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    with serve_fake_provider() as fake:
        yield fake


def local_profile(provider: FakeProvider, redis_url: str) -> Any:
    return load_settings(
        {
            "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"),
            "FLEET_PROFILE": "local",
            "FLEET_REDIS_URL": redis_url,
            "FLEET_LM_MODEL": "openai/boundary-model",
            "FLEET_LM_API_KEY": API_KEY,
            "FLEET_LM_BASE_URL": provider.url,
        }
    )


def test_local_profile_reaches_an_openai_compatible_endpoint(provider: FakeProvider, redis_url: str) -> None:
    settings = local_profile(provider, redis_url)
    assert settings.root_lm.name == "openai/boundary-model" and not settings.root_lm.scripted
    assert API_KEY not in repr(settings.root_lm)
    provider.replies.append("pong")
    lm = dspy_adapter.build_lm(settings.root_lm, "root", None, threading.Event())
    assert lm("ping") == ["pong"]
    request = provider.requests[0]
    assert request["path"].endswith("/chat/completions")
    assert request["model"] == "boundary-model"
    assert request["messages"][-1]["content"] == "ping"
    assert provider.headers[0]["authorization"] == f"Bearer {API_KEY}"


def test_a_whole_rlm_turn_runs_on_the_provider_path(provider: FakeProvider, redis_url: str) -> None:
    """Root actions and the llm_query answer come over HTTP; the cells run in a real bwrap sandbox."""
    provider.replies += [
        "[[ ## reasoning ## ]]\nAsk the sub-LM.\n\n[[ ## code ## ]]\nr = llm_query('hi')\nprint(r)\n\n"
        "[[ ## completed ## ]]",
        "sub answer",
        "[[ ## reasoning ## ]]\nDone.\n\n[[ ## code ## ]]\nSUBMIT(answer=r.upper())\n\n[[ ## completed ## ]]",
    ]
    events: list[Any] = []
    result = run_on_provider(local_profile(provider, redis_url), provider, events.append)
    assert result.answer == "SUB ANSWER"
    assert result.iterations == 2
    assert result.lm_usage["openai/boundary-model"]["prompt_tokens"] == 11 * 3
    assert [r["model"] for r in provider.requests] == ["boundary-model"] * 3
    assert all(h["authorization"] == f"Bearer {API_KEY}" for h in provider.headers)
    assert not any(API_KEY in repr(event) for event in events)


@pytest.mark.parametrize("credentials_in_url", [False, True])
def test_a_provider_error_shows_users_a_code_not_the_providers_text(
    provider: FakeProvider, redis_url: str, credentials_in_url: bool
) -> None:
    """A 401 from the provider, or a base URL with credentials in it: the failure a user sees
    names DSPy's code (and the status), never the provider's text or the URL's password."""
    from fleet_worker.outcome import failure_outcome

    settings = local_profile(provider, redis_url)
    base_url = provider.url
    if credentials_in_url:
        base_url = base_url.replace("http://", "http://proxyuser:PROXY-PASSWORD-xyz@")
    lm_settings = msgspec.structs.replace(settings.root_lm, base_url=base_url, num_retries=0)
    provider.status = 401
    lm = dspy_adapter.build_lm(lm_settings, "root", None, threading.Event())
    with pytest.raises(Exception) as raised:
        lm("ping")
    assert dspy_adapter.is_lm_error(raised.value)
    outcome = failure_outcome(raised.value)
    message = outcome.failure_message or ""
    assert outcome.failure_code == "lm_error" and message.startswith("the LM call failed (")
    if not credentials_in_url:
        assert "HTTP 401" in message
    for leak in ("PROXY-PASSWORD", "proxyuser", API_KEY, "OPENAI_API_KEY", "Incorrect"):
        assert leak not in message


def test_a_request_timeout_bounds_each_call(provider: FakeProvider, redis_url: str) -> None:
    """`llm.*.request_timeout_seconds`: a provider that does not answer fails the call in time,
    so a stopped Turn never waits on it for long."""
    settings = local_profile(provider, redis_url)
    lm_settings = msgspec.structs.replace(settings.root_lm, num_retries=0, request_timeout=1.0)
    provider.delay_s = 5.0
    provider.replies.append("too late")
    lm = dspy_adapter.build_lm(lm_settings, "root", None, threading.Event())
    started = time.monotonic()
    with pytest.raises(Exception) as raised:
        lm("ping")
    assert time.monotonic() - started < 4.5
    assert dspy_adapter.is_lm_error(raised.value) or "timeout" in type(raised.value).__name__.lower()


def test_a_rate_limit_is_retried_and_a_401_is_not(provider: FakeProvider, redis_url: str) -> None:
    settings = local_profile(provider, redis_url)
    lm_settings = msgspec.structs.replace(settings.root_lm, num_retries=2)
    provider.statuses = [429]
    provider.replies.append("after the 429")
    lm = dspy_adapter.build_lm(lm_settings, "root", None, threading.Event())
    assert lm("ping") == ["after the 429"]
    assert len(provider.requests) == 2
    provider.requests.clear()
    provider.statuses = [401]
    with pytest.raises(Exception) as raised:
        lm("ping again")
    assert dspy_adapter.is_lm_error(raised.value)
    assert len(provider.requests) == 1  # an auth error is final


def test_an_answer_the_lm_writes_itself_streams_while_its_call_is_in_flight(
    provider: FakeProvider, redis_url: str
) -> None:
    """No SUBMIT within rlm.max_iters: DSPy's extract fallback has the LM write the answer, which
    is emitted in AnswerDelta events well before the call's last token; the Turn's answer is the
    parsed text, and the deltas carried its start."""
    from fleet_shared.events import AnswerDelta

    answer = "The request says hi, so the answer is a friendly greeting back to the user."
    provider.ttft_s, provider.tokens_per_s = 0.3, 20
    provider.replies += [
        "[[ ## reasoning ## ]]\nLook first.\n\n[[ ## code ## ]]\nprint(1)\n\n[[ ## completed ## ]]",
        f"[[ ## answer ## ]]\n{answer}\n\n[[ ## completed ## ]]",
    ]
    emitted: list[tuple[float, Any]] = []
    result = run_on_provider(
        local_profile(provider, redis_url),
        provider,
        lambda e: emitted.append((time.monotonic(), e)),
        max_iters=1,
    )
    assert result.answer == answer and len(provider.requests) == 2
    call_ended = provider.chunk_times[-1]  # the extract call's last chunk
    deltas = [(at, e) for at, e in emitted if isinstance(e, AnswerDelta)]
    assert len(deltas) >= 3 and {e.part_id for _, e in deltas} == {"text-answer"}
    assert deltas[0][0] < call_ended - 1.0  # the first delta came a second before the call ended
    streamed = "".join(e.delta for _, e in deltas)
    assert streamed == result.streamed_answer and answer.startswith(streamed.strip())


def run_on_provider(settings: Any, provider: FakeProvider, emit: Any, max_iters: int = 4) -> Any:
    """One program on the provider path, in a real bwrap sandbox."""
    import shutil
    import tempfile

    from fleet_worker.app import sandbox_provider

    workspace = Path(tempfile.mkdtemp(prefix="fleet-provider-"))
    workspace.chmod(0o711)
    settings = msgspec.structs.replace(settings, data_dir=workspace)
    lease = sandbox_provider(settings).acquire("ws", "run-provider")
    stop = threading.Event()
    try:
        return dspy_adapter.run_program(
            request="say hi",
            history=[],
            root_lm=dspy_adapter.build_lm(settings.root_lm, "root", None, stop),
            sub_lm=dspy_adapter.build_lm(settings.sub_lm, "sub", None, stop),
            limits=dspy_adapter.ProgramLimits(max_iters=max_iters, max_llm_calls=4, max_output_chars=1000),
            observer=dspy_adapter.TurnObserver(
                emit=emit, run_id="run-provider", stop=stop, max_output_chars=1000
            ),
            interpreter_factory=lease.interpreter_factory,
        )
    finally:
        lease.release()
        shutil.rmtree(workspace, ignore_errors=True)


def test_reasoning_reaches_the_stream_while_its_lm_call_is_still_in_flight(
    provider: FakeProvider, redis_url: str
) -> None:
    """The provider streams (first token after 300 ms, then 20 tokens a second): the step's
    reasoning is emitted in deltas well before the call's last token, and the whole text after."""
    from fleet_shared.events import CodeCell, CodeDelta, Reasoning, ReasoningDelta

    reasoning = "Think it through slowly, one small step after another, then answer."
    provider.ttft_s, provider.tokens_per_s = 0.3, 20
    code = "```python\nword = 'hi'\nSUBMIT(answer=word)\n```"  # fenced, as the RLM is asked to write it
    provider.replies.append(
        f"[[ ## reasoning ## ]]\n{reasoning}\n\n[[ ## code ## ]]\n{code}\n\n[[ ## completed ## ]]"
    )
    emitted: list[tuple[float, Any]] = []
    result = run_on_provider(
        local_profile(provider, redis_url), provider, lambda e: emitted.append((time.monotonic(), e))
    )
    assert result.answer == "hi"
    call_ended = provider.chunk_times[-1]  # the one call's last chunk
    deltas = [(at, e) for at, e in emitted if isinstance(e, ReasoningDelta)]
    assert len(deltas) >= 3
    assert deltas[0][0] < call_ended - 1.0  # the first delta came a second before the call ended
    assert "".join(e.delta for _, e in deltas).strip() == reasoning
    whole = [e for _, e in emitted if isinstance(e, Reasoning)]
    assert len(whole) == 1 and whole[0].text == reasoning and whole[0].streamed
    assert emitted.index(next(x for x in emitted if x[1] is whole[0])) > emitted.index(deltas[-1])
    # The code streams too, as the cell's deltas without its fence, before the call's last token;
    # the cell's CodeCell then holds what it runs.
    code_deltas = [(at, e) for at, e in emitted if isinstance(e, CodeDelta)]
    assert code_deltas and code_deltas[0][0] < call_ended - 0.2
    assert {e.call_id for _, e in code_deltas} == {"cell-1"}
    assert "".join(e.delta for _, e in code_deltas) == "word = 'hi'\nSUBMIT(answer=word)\n"
    cell = next(e for _, e in emitted if isinstance(e, CodeCell))
    assert cell.code == "word = 'hi'\nSUBMIT(answer=word)"


def test_an_lm_error_on_the_stream_is_an_lm_error(provider: FakeProvider, redis_url: str) -> None:
    from fleet_worker.outcome import failure_outcome

    settings = local_profile(provider, redis_url)
    settings = msgspec.structs.replace(
        settings, root_lm=msgspec.structs.replace(settings.root_lm, num_retries=0)
    )
    provider.status = 401
    with pytest.raises(Exception) as raised:
        run_on_provider(settings, provider, lambda _e: None)
    outcome = failure_outcome(raised.value)
    assert outcome.failure_code == "lm_error" and "HTTP 401" in (outcome.failure_message or "")
    assert API_KEY not in (outcome.failure_message or "")


def test_a_streamed_reply_dspy_cannot_parse_is_asked_again_off_the_stream(
    provider: FakeProvider, redis_url: str
) -> None:
    """DSPy neither retries nor falls back to JSON once a call's tokens were streamed: fleet makes
    the call once more off the stream, and the step's reasoning is restated from that reply."""
    from fleet_shared.events import Reasoning, ReasoningDelta

    provider.replies += [
        "[[ ## reasoning ## ]]\nA first try with no code field.\n\n[[ ## completed ## ]]",
        "[[ ## reasoning ## ]]\nSecond try.\n\n[[ ## code ## ]]\nSUBMIT(answer='ok')\n\n"
        "[[ ## completed ## ]]",
    ]
    emitted: list[Any] = []
    result = run_on_provider(local_profile(provider, redis_url), provider, emitted.append)
    assert result.answer == "ok"
    assert [bool(r.get("stream")) for r in provider.requests] == [True, False]
    assert any(isinstance(e, ReasoningDelta) and "first try" in e.delta for e in emitted)
    whole = [e for e in emitted if isinstance(e, Reasoning)]
    assert len(whole) == 1 and whole[0].restated and whole[0].text == "Second try."


def test_code_that_streamed_but_could_not_be_run_ends_its_cell_as_shown(
    provider: FakeProvider, redis_url: str
) -> None:
    """A step's code in a bash fence streams, then DSPy refuses it as Python (no cell starts):
    its cell ends as it was shown, with an error, before the next step; the Turn goes on."""
    from fleet_shared.events import CellOutput, CodeCell, CodeDelta
    from fleet_worker.observer import UNRUN_CELL_TEXT

    provider.ttft_s, provider.tokens_per_s = 0.05, 200

    def action(reasoning: str, code: str) -> str:
        return f"[[ ## reasoning ## ]]\n{reasoning}\n\n[[ ## code ## ]]\n{code}\n\n[[ ## completed ## ]]"

    provider.replies += [
        action("List it.", "```bash\nls -la\n```"),
        action("Python.", "SUBMIT(answer='done')"),
    ]
    emitted: list[Any] = []
    result = run_on_provider(local_profile(provider, redis_url), provider, emitted.append)
    assert result.answer == "done"
    assert (
        "".join(e.delta for e in emitted if isinstance(e, CodeDelta) and e.call_id == "cell-1") == "ls -la\n"
    )
    cells = [(type(e).__name__, e.call_id) for e in emitted if isinstance(e, CodeCell | CellOutput)]
    assert cells == [
        ("CodeCell", "cell-1"),
        ("CellOutput", "cell-1"),
        ("CodeCell", "cell-2"),
        ("CellOutput", "cell-2"),
    ]
    unrun = next(e for e in emitted if isinstance(e, CellOutput) and e.call_id == "cell-1")
    assert unrun.error == UNRUN_CELL_TEXT
