"""The OpenAPI document the gateway serves is the committed `openapi.yaml`: a change to a route,
a body or an error that is not committed fails here. Regenerate with `just openapi`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from litestar.testing import TestClient

from fleet_gateway.app import create_app
from tests.integration.harness import Harness

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "openapi.yaml"


@pytest.fixture
def served(harness_factory: Any) -> dict[str, Any]:
    harness: Harness = harness_factory({"lm": "root", "reasoning": "r", "code": "SUBMIT(answer='x')"})
    with TestClient(create_app(harness.settings)) as client:
        as_json = client.get("/schema/openapi.json")
        as_yaml = client.get("/schema/openapi.yaml")
    assert as_json.status_code == 200 and as_yaml.status_code == 200
    document: dict[str, Any] = as_json.json()
    assert yaml.safe_load(as_yaml.text) == document
    return document


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_served_document_is_the_committed_one(served: dict[str, Any]) -> None:
    committed = yaml.safe_load(COMMITTED.read_text(encoding="utf-8"))
    assert served == committed, "openapi.yaml drifted from the app: run `just openapi` and commit it"


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_every_operation_documents_the_envelope_and_the_request_id(served: dict[str, Any]) -> None:
    for path, item in served["paths"].items():
        for method, operation in item.items():
            responses = operation["responses"]
            assert "400" not in responses, f"{method} {path}: validation failures are 422 envelopes"
            for status in ("422", "500", "503"):
                schema = responses[status]["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/Error"}, (method, path, status)
            assert all("x-request-id" in r.get("headers", {}) for r in responses.values()), (method, path)
    turn = served["paths"]["/api/sessions/{session_id}/turns"]["post"]
    assert "text/event-stream" in turn["responses"]["200"]["content"]
    assert turn["requestBody"]["content"]["application/json"]["examples"]["turn"]["value"]["text"]
    assert set(served["components"]["schemas"]["Error"]["required"]) == {"code", "message"}
