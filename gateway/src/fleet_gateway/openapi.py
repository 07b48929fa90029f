"""The served OpenAPI document: generated from the app, then given what Litestar cannot infer.

Litestar documents a validation failure as its own 400 body. Ours are the `{code, message}`
envelope (docs/api.md), so at startup every operation gets the error responses it can really
give, all pointing at one `Error` schema, and the `x-request-id` header on every response. The
committed `openapi.yaml` is this document; `tests/integration/test_openapi.py` fails on drift.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from litestar import Litestar
from litestar.enums import ParamType
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin, YamlRenderPlugin
from litestar.openapi.spec import (
    Components,
    Example,
    OpenAPI,
    OpenAPIHeader,
    OpenAPIMediaType,
    OpenAPIResponse,
    Operation,
    Parameter,
    Reference,
    RequestBody,
    Schema,
)
from litestar.openapi.spec.enums import OpenAPIFormat, OpenAPIType

DESCRIPTION = (
    "fleet runs Recursive Language Model Turns. Every error is `{code, message}` with an "
    "`x-request-id` header (as every response has). The Turn POST answers `text/event-stream` "
    "in the AI SDK UI message stream v1 format; docs/api.md describes each chunk."
)
OPEN_PATHS = ("/health", "/ready", "/metrics", "/schema")  # no bearer token asked
ERROR_EXAMPLE = {"code": "not_found", "message": "session not found"}
TURN_EXAMPLE: dict[str, object] = {
    "text": "Summarise the attached report in five bullet points.",
    "attachment_ids": ["0f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0"],
    "skill_selections": [{"id": "long-document-qa", "expected_version": "1.0"}],
}
ERRORS: dict[str, str] = {
    "401": "`auth_required`: the bearer credential (gateway.auth.mode) is missing or not valid",
    "403": (
        "`forbidden`: the route is for callers with the `admin` scope (settings: on loopback only), "
        "or a Turn names a `program_version` without it; "
        "`origin_not_allowed`: a change from a web "
        "page of another origin (gateway.cors); `upload_header_required`: an upload without "
        "X-Requested-With or a bearer token"
    ),
    "404": "`not_found`: an unknown (or another caller's) resource, or route",
    "405": "`method_not_allowed`, with `Allow`",
    "408": "`upload_timeout`: the upload sent nothing for gateway.limits.upload_idle_seconds",
    "409": (
        "`turn_in_progress`, `queue_full`, `idempotency_key_mismatch`, `session_archived`, "
        "`settings_revision_conflict`, `approval_decided`"
    ),
    "413": "`payload_too_large`: the body is over gateway.limits.max_body_bytes",
    "415": "`unsupported_media_type`: send JSON",
    "416": "`range_not_satisfiable`",
    "421": "`host_not_allowed`: the Host header is not a name this gateway answers to",
    "422": (
        "`validation_error`, `invalid_skill_selection`, `invalid_webhook`: the request breaks the "
        "schema or a rule"
    ),
    "429": "`too_many_uploads`: this client has gateway.limits.max_concurrent_uploads_per_client "
    "uploads in progress; `quota_exceeded`: the tenant is at quotas.active_turns or "
    "quotas.turns_per_minute; see Retry-After",
    "431": "`headers_too_large`: the headers are over gateway.limits.max_header_bytes",
    "500": "`internal_error`: a bug; details only in the server log",
    "503": "`service_unavailable`: the database, Redis or the blob store is down; retry",
    "507": "`storage_quota_exceeded`: the blob store is at a quota (storage.quota_*, quotas.storage_mb); "
    "nothing was stored",
}


def openapi_config(version: str) -> OpenAPIConfig:
    return OpenAPIConfig(
        title="fleet",
        version=version,
        description=DESCRIPTION,
        path="/schema",
        render_plugins=[JsonRenderPlugin(), YamlRenderPlugin()],
        use_handler_docstrings=True,
    )


def document_errors(app: Litestar) -> None:
    """An on_startup hook: complete the document before it is first rendered."""
    complete(app.openapi_schema)


def complete(document: OpenAPI) -> None:
    components = document.components
    if isinstance(components, list):  # pragma: no cover - we never configure a list
        return
    components = components or Components()
    document.components = components
    components.schemas = dict(components.schemas or {})
    components.schemas["Error"] = Schema(
        type=OpenAPIType.OBJECT,
        required=["code", "message"],
        properties={"code": Schema(type=OpenAPIType.STRING), "message": Schema(type=OpenAPIType.STRING)},
        examples=[ERROR_EXAMPLE],
    )
    for path, item in (document.paths or {}).items():
        for method in ("get", "put", "post", "patch", "delete"):
            operation = getattr(item, method, None)
            if operation is not None:
                add_errors(path, method, operation)
    paths = document.paths or {}
    turns = paths.get("/api/sessions/{session_id}/turns")
    if turns is not None and turns.post is not None:
        add_example(turns.post, TURN_EXAMPLE)
    upload = paths.get("/api/attachments")
    if upload is not None and upload.post is not None:
        upload.post.request_body = UPLOAD_BODY  # the route parses multipart itself, streaming
        upload.post.parameters = [*(upload.post.parameters or []), UPLOAD_MARK]
    content = paths.get("/api/artifacts/{artifact_id}/content")
    if content is not None and content.get is not None:
        document_download(content.get)
    resume = paths.get("/api/runs/{run_id}/stream")
    if resume is not None and resume.get is not None:
        document_resume(resume.get)


def document_download(operation: Operation) -> None:
    """The artifact's bytes, in its own media type, whole (200), by range (206), or not at all (304)."""
    responses = dict(operation.responses or {})
    binary = {"*/*": OpenAPIMediaType(schema=Schema(type=OpenAPIType.STRING, format=OpenAPIFormat.BINARY))}
    for status, description in (
        ("200", 'the whole file, with Content-Length and ETag: "<sha256>"'),
        ("206", "the requested byte range (Range: bytes=…)"),
    ):
        responses[status] = OpenAPIResponse(
            description=description, content=binary, headers={"x-request-id": REQUEST_ID}
        )
    responses["304"] = OpenAPIResponse(
        description="If-None-Match named its ETag: nothing changed", headers={"x-request-id": REQUEST_ID}
    )
    operation.responses = responses


def document_resume(operation: Operation) -> None:
    responses = dict(operation.responses or {})
    ok = responses.get("200")
    if isinstance(ok, OpenAPIResponse):
        ok.content = {"text/event-stream": OpenAPIMediaType(schema=Schema(type=OpenAPIType.STRING))}
        ok.description = "the frames after Last-Event-ID (all of them without it), live or from the DB"
    responses["204"] = OpenAPIResponse(
        description="the Run is unknown to this caller: nothing to resume",
        headers={"x-request-id": REQUEST_ID},
    )
    operation.responses = responses


def add_example(operation: Operation, example: dict[str, object]) -> None:
    body = operation.request_body
    if isinstance(body, RequestBody) and "application/json" in (body.content or {}):
        body.content["application/json"].examples = {"turn": Example(value=example)}


def add_errors(path: str, method: str, operation: Operation) -> None:
    responses = dict(operation.responses or {})
    responses.pop("400", None)  # Litestar's own validation body; ours is a 422 envelope
    for status in statuses(path, method, operation):
        responses.setdefault(status, error_response(ERRORS[status]))
    for response in responses.values():
        if isinstance(response, OpenAPIResponse):
            response.headers = {**(response.headers or {}), "x-request-id": REQUEST_ID}
    operation.responses = responses


def statuses(path: str, method: str, operation: Operation) -> list[str]:
    found = ["421", "422", "500", "503"]  # 421: a Host header of another name, before any route
    if not path.startswith(OPEN_PATHS):
        found.append("401")
    if "{" in path:
        found.append("404")
    if operation.request_body is not None:
        found.append("413")
    if method in ("post", "put", "patch"):
        found.append("415")  # a body that is not JSON (the upload: not multipart)
    if method in ("post", "put", "patch", "delete"):
        found.append("403")  # from a web page of another origin
    if path == "/api/settings":
        found += ["403", "409"] if method == "patch" else ["403"]
    if path.startswith("/api/programs"):
        found.append("403")  # the `admin` scope only
    if path == "/api/programs/active":
        found.append("404")  # an unknown version named in the body
    if method == "post" and path.endswith("/turns"):
        found += ["409", "429"]
    if method == "post" and "/approvals/" in path:
        found.append("409")
    if method == "post" and path.endswith("/fork"):
        found.append("507")
    if path.endswith("/content") and path.startswith("/api/artifacts"):
        found.append("416")
    if path.startswith(("/api/files", "/api/volume")):  # the session named in the query
        found.append("404")
    if path == "/api/attachments" and method == "post":
        found += ["408", "413", "429", "507"]
    if path == "/api/files/content":
        found.append("415")  # a binary file: fetch it as an artifact instead
    found.append("431")
    return sorted(set(found))


def error_response(description: str) -> OpenAPIResponse:
    return OpenAPIResponse(
        description=description,
        content={
            "application/json": OpenAPIMediaType(
                schema=Reference(ref="#/components/schemas/Error"),
                examples={"error": Example(value=ERROR_EXAMPLE)},
            )
        },
    )


UPLOAD_BODY = RequestBody(
    required=True,
    description="multipart/form-data with one file field, `attachment` (size-capped)",
    content={
        "multipart/form-data": OpenAPIMediaType(
            schema=Schema(
                type=OpenAPIType.OBJECT,
                required=["attachment"],
                properties={"attachment": Schema(type=OpenAPIType.STRING, format=OpenAPIFormat.BINARY)},
            )
        )
    },
)
UPLOAD_MARK = Parameter(
    name="X-Requested-With",
    param_in=ParamType.HEADER,
    required=False,
    schema=Schema(type=OpenAPIType.STRING),
    description="any value; needed unless a bearer token is sent (a plain web form cannot send either)",
)
REQUEST_ID = OpenAPIHeader(
    schema=Schema(type=OpenAPIType.STRING),
    description="the request's id: the caller's `x-request-id` when it is safe to echo, else a new one",
)


def main(argv: list[str]) -> int:
    """`python -m fleet_gateway.openapi openapi.yaml` (`just openapi`): write the document the
    app serves, without starting it (nothing is connected to)."""
    import yaml

    from fleet_gateway.app import create_app
    from fleet_shared.config import load_settings

    environ = {"FLEET_REDIS_URL": "redis://127.0.0.1:1/0", **os.environ, "FLEET_PROFILE": "offline"}
    app = create_app(load_settings(environ, lm_credentials=False))
    document_errors(app)
    text = yaml.safe_dump(app.openapi_schema.to_schema(), sort_keys=False, allow_unicode=True, width=100)
    Path(argv[0]).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
