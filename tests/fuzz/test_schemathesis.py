"""schemathesis against the live gateway: every operation of `/schema/openapi.json`, fuzzed.

One stack per module: real `fleet gateway` and `fleet worker` processes on a private Redis and
SQLite, the scripted LM (tests/e2e/scripts/fuzz.jsonl: each Turn writes an artifact and answers)
and `gateway.auth.mode = jwt` against a loopback JWKS. The policy file is a private copy, since
`PATCH /api/settings` may rewrite it.

Each generated request is sent with the JWT; most path ids (and the files API's `session_id`)
are swapped for ids that exist, so the fuzzer gets past the 404s into the routes' own checks.
Every response must:
- not be a 5xx (`not_a_server_error`);
- have a documented status and content type (`status_code_conformance`,
  `content_type_conformance`);
- match its documented schema (`response_schema_conformance`), except the Turn streams, which
  schemathesis cannot read: those must keep the stream contract (tests/e2e/contract.py) instead;
- carry `x-request-id`, and when it is an error, be the `{code, message}` envelope.

FLEET_FUZZ_EXAMPLES bounds the examples per operation (default 10, which keeps the run well
under two minutes); `just fuzz` runs 200, with a fresh random seed each time.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from fleet_shared.tenancy import ADMIN, READ_ALL_SESSIONS
from tests.e2e.conftest import REPO, Stack, start_stack, stop_stack, work_dir
from tests.e2e.contract import check_stream
from tests.e2e.sse import parse_frames, post_turn
from tests.support.idp import LoopbackIdp
from tests.support.policy import private_policy

DEFAULT_EXAMPLES = 10
EXAMPLES = int(os.environ.get("FLEET_FUZZ_EXAMPLES", DEFAULT_EXAMPLES))
# The short run in the default suite is derandomized (the same examples each time, so CI is
# stable); a longer run (`just fuzz`) explores with a random seed.
DERANDOMIZE = EXAMPLES <= DEFAULT_EXAMPLES
# Every request carries a JWT of the stack's OIDC provider (a loopback JWKS), set by fuzz_stack.
AUTH: dict[str, str] = {}
SCRIPT = REPO / "tests" / "e2e" / "scripts" / "fuzz.jsonl"
STREAMS = {("POST", "/api/sessions/{session_id}/turns"), ("GET", "/api/runs/{run_id}/stream")}
# Which real id stands in for a generated path or query parameter of this name.
REAL_IDS = ("session_id", "run_id", "attachment_id", "artifact_id", "skill_id")
SETTING_KEYS = (
    "profiles.offline.rlm.max_iters",
    "profiles.offline.runtime.heartbeat_seconds",
    "profiles.offline.gateway.limits.max_text_chars",
    "profiles.offline.observability.log_level",
    "profiles.offline.sandbox.local.cell_timeout_seconds",
    "config.default_profile",  # file-only: always refused
)
REAL_PATHS = ("", ".", "artifacts", "artifacts/request.txt", "attachments/a.txt", "memory")

pytestmark = pytest.mark.fuzz


@pytest.fixture(scope="module")
def fuzz_stack() -> Iterator[Stack]:
    data_dir = work_dir("fuzz")
    idp = LoopbackIdp()
    token = idp.token(tenant="fuzz", user="fuzzer", scopes=(ADMIN, READ_ALL_SESSIONS))
    AUTH["Authorization"] = f"Bearer {token}"
    env = {**private_policy(data_dir), "FLEET_SCRIPTED_LM": str(SCRIPT), **idp.env()}
    stack = start_stack(data_dir, env)
    refused = httpx.get(f"{stack.url}/api/sessions", timeout=30)
    assert refused.status_code == 401, "the stack must check the JWT, or the fuzzing proves nothing about it"
    yield stack
    stop_stack(stack)
    idp.stop()


def new_session(stack: Stack) -> str:
    response = httpx.post(f"{stack.url}/api/sessions", json={"title": "fuzz"}, headers=AUTH, timeout=30)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


@pytest.fixture(scope="module")
def real_ids(fuzz_stack: Stack) -> dict[str, str]:
    """A session with one finished Turn, its attachment and its artifact."""
    with httpx.Client(base_url=fuzz_stack.url, timeout=60, headers=AUTH) as client:
        session_id = new_session(fuzz_stack)
        upload = client.post("/api/attachments", files={"attachment": ("a.txt", b"fuzz\n", "text/plain")})
        assert upload.status_code == 201, upload.text
        stream = post_turn(client, session_id, "seed", "fuzz-seed", attachment_ids=[upload.json()["id"]])
        assert stream.chunks[-1].get("finishReason") == "stop", stream.chunks[-3:]
        artifact = stream.of_type("data-artifact")[0]["data"]
        skill = client.get("/api/skills").json()["items"][0]["id"]
    return {
        "session_id": session_id,
        "run_id": stream.headers["x-fleet-run-id"],
        "attachment_id": upload.json()["id"],
        "artifact_id": artifact["artifact_id"],
        "skill_id": skill,
    }


def prefer_real(value: Any) -> bool:
    """Two generated values in three give way to a real id (a pure function of the value, so a
    failing example shrinks and replays the same way)."""
    return zlib.crc32(repr(value).encode("utf-8", "surrogatepass")) % 3 != 0


def use_real_ids(case: Any, ids: dict[str, str], stack: Stack) -> None:
    for container in (case.path_parameters, case.query):
        if not container:
            continue
        for name in REAL_IDS:
            if name in container and prefer_real(container[name]):
                container[name] = ids[name]
    # The seeded session's workspace, so the files API gets past "no such file" too.
    for name in ("path", "root"):
        if case.query and name in case.query and prefer_real(case.query[name]):
            case.query[name] = REAL_PATHS[zlib.crc32(repr(case.query[name]).encode()) % len(REAL_PATHS)]
    if case.operation.path == "/api/settings" and isinstance(case.body, dict):
        use_real_settings(case.body, stack)


def use_real_settings(body: dict[str, Any], stack: Stack) -> None:
    """The policy file's current revision and keys that exist, so a change gets past the conflict
    and unknown-key checks to the value validation and the write (of the stack's private copy)."""
    if "revision" in body and prefer_real(body["revision"]):
        current = httpx.get(f"{stack.url}/api/settings", headers=AUTH, timeout=30)
        body["revision"] = current.json()["revision"]
    changes = body.get("set")
    if isinstance(changes, dict) and changes and prefer_real(sorted(changes)):
        body["set"] = {
            SETTING_KEYS[zlib.crc32(key.encode("utf-8", "surrogatepass")) % len(SETTING_KEYS)]: value
            for key, value in changes.items()
        }


def check_envelope(response: Any) -> None:
    assert response.headers.get("x-request-id"), "a response without x-request-id"
    if response.status_code < 400:
        return
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError("an error answer that is not JSON") from None
    assert isinstance(body, dict) and set(body) == {"code", "message"}, f"not the error envelope: {body}"
    assert isinstance(body["code"], str) and isinstance(body["message"], str) and body["message"], body


def header(response: Any, name: str) -> str:
    value = response.headers.get(name)
    if isinstance(value, list):  # schemathesis keeps every value of a header
        return str(value[0])
    return str(value or "")


@dataclass
class Tally:
    examples: int = 0
    failures: list[str] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)

    def report(self, operation: Any, examples: int, seconds: float) -> str:
        """One line per operation; statuses the spec does not list are named (for the OpenAPI
        work, not a failure here)."""
        documented = set(operation.definition.raw.get("responses", {}))
        undocumented = sorted(code for code in self.statuses if str(code) not in documented)
        return (
            f"fuzz {operation.label}: {examples} examples in {seconds:.1f}s, "
            f"statuses {dict(sorted(self.statuses.items()))}, undocumented {undocumented}\n"
        )


def fuzz_operation(operation: Any, stack: Stack, ids: dict[str, str], tally: Tally) -> None:
    """Hypothesis over one operation: valid and invalid requests alike (schemathesis's positive
    and negative modes)."""
    strategies = [operation.as_strategy(GenerationMode.POSITIVE)]
    if operation.path_parameters or operation.query or operation.headers or operation.body:
        strategies.append(operation.as_strategy(GenerationMode.NEGATIVE))

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=DERANDOMIZE,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @given(case=st.one_of(strategies))
    def run(case: Any) -> None:
        tally.examples += 1
        tally.statuses[send_and_check(case, stack, ids)] += 1

    run()


def send_and_check(case: Any, stack: Stack, ids: dict[str, str]) -> int:
    use_real_ids(case, ids, stack)
    response = case.call(base_url=stack.url, headers=AUTH, timeout=120)
    try:
        check_response(case, response)
    except AssertionError as exc:  # schemathesis's own failures carry a curl line; ours get one too
        curl = case.as_curl_command(headers=AUTH)
        body = response.content[:1000].decode(errors="replace")
        raise AssertionError(f"{exc}\n[{response.status_code}] {body}\nReproduce with:\n    {curl}") from None
    return int(response.status_code)


def check_response(case: Any, response: Any) -> None:
    is_stream = header(response, "content-type").startswith("text/event-stream")
    if (case.method.upper(), case.operation.path) in STREAMS and is_stream:
        # schemathesis cannot read an event stream: its status is checked here, its body against
        # the stream contract.
        case.validate_response(response, checks=[not_a_server_error, status_code_conformance])
        headers = {k: header(response, k) for k in response.headers}
        check_stream(parse_frames(response.content), headers, delivery=None, status=response.status_code)
    else:
        checks = [
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ]
        case.validate_response(response, checks=checks)
    check_envelope(response)


@pytest.mark.timeout(300 + 10 * EXAMPLES)
def test_the_gateway_survives_fuzzing(fuzz_stack: Stack, real_ids: dict[str, str]) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzz_stack.url}/schema/openapi.json", timeout=30)
    tally = Tally()
    operations = 0
    for result in schema.get_all_operations():
        operations += 1
        if not isinstance(result, Ok):  # the spec describes an operation schemathesis cannot read
            tally.failures.append(f"invalid schema: {result.err()}")
            continue
        operation = result.ok()
        before, tally.statuses = tally.examples, Counter()
        started = time.monotonic()
        ids = dict(real_ids)
        if "{session_id}" in operation.path:
            # A session of its own, so an earlier operation (a PATCH that archived the session, a
            # Turn still settling) does not turn this one's requests away.
            ids["session_id"] = new_session(fuzz_stack)
        try:
            fuzz_operation(operation, fuzz_stack, ids, tally)
        except Exception as exc:  # every operation runs; all failures are reported together
            tally.failures.append(f"{operation.label}: {type(exc).__name__}: {exc}")
        sys.stderr.write(tally.report(operation, tally.examples - before, time.monotonic() - started))
    summary = f"{operations} operations, {tally.examples} examples, {len(tally.failures)} failing operations"
    sys.stderr.write(f"fuzz: {summary}\n")
    assert operations > 0, "the served schema has no operations"
    assert not tally.failures, "\n\n".join(tally.failures)
