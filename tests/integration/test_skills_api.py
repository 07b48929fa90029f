"""`GET /api/skills` and `GET /api/skills/{id}` in-process (Litestar's test client) on real
SQLite/PostgreSQL (seeded with the built-in cards by the fixtures) and Redis."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from litestar.testing import TestClient

from fleet_gateway.app import create_app
from fleet_shared.config import Settings, load_settings
from fleet_shared.skills import load_skill_cards, seed_skills
from tests.support.api import ApiClient

REPO = Path(__file__).resolve().parents[2]
SHIPPED = {card.id: card for card in load_skill_cards(REPO / "config" / "skills")}


@pytest.fixture
def settings(database_url: str, redis_url: str) -> Settings:
    return load_settings(
        {
            "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"),
            "FLEET_DATABASE_URL": database_url,
            "FLEET_REDIS_URL": redis_url,
        }
    )


@pytest.fixture
def client(settings: Settings) -> Iterator[ApiClient]:
    with TestClient(create_app(settings)) as client:
        yield client


def test_the_list_holds_the_built_in_cards_without_bodies(client: ApiClient) -> None:
    response = client.get("/api/skills")
    assert response.status_code == 200
    items = response.json()["items"]
    assert [i["id"] for i in items] == sorted(i["id"] for i in items)
    listed = {i["id"]: i for i in items}
    for skill_id, card in SHIPPED.items():
        assert listed[skill_id] == {
            "id": skill_id,
            "name": card.name,
            "version": card.version,
            "description": card.description,
        }


@pytest.mark.parametrize(
    ("q", "expected"),
    [
        ("csv", "csv-analysis"),  # the id
        ("CODE REVIEW", "code-review"),  # the name, any case
        ("llm_query_batched", "long-document-qa"),  # the description
    ],
)
def test_q_searches_ids_names_and_descriptions(client: ApiClient, q: str, expected: str) -> None:
    items = client.get("/api/skills", params={"q": q}).json()["items"]
    assert expected in [i["id"] for i in items]
    assert "research-notes" not in [i["id"] for i in items]


def test_q_is_bounded_and_an_unmatched_q_lists_nothing(client: ApiClient) -> None:
    assert client.get("/api/skills", params={"q": f"no-{uuid.uuid4().hex}"}).json() == {"items": []}
    too_long = client.get("/api/skills", params={"q": "x" * 201})
    assert too_long.status_code == 422 and too_long.json()["code"] == "validation_error"
    nul = client.get("/api/skills", params={"q": "a\x00b"})
    assert nul.status_code == 422 and nul.json()["code"] == "validation_error"


def test_the_list_stops_at_100(
    client: ApiClient,
    settings: Settings,
    tmp_path: Path,
) -> None:
    tag = uuid.uuid4().hex[:8]  # `zz-`: the rows sort after the ones other tests list
    for i in range(101):
        body = f'+++\nname = "n"\nversion = "1"\ndescription = "bulk{tag}"\n+++\nbody\n'
        (tmp_path / f"zz-bulk{tag}-{i:03}.md").write_text(body)
    seed_skills(settings.database_url, tmp_path)
    items = client.get("/api/skills", params={"q": f"bulk{tag}"}).json()["items"]
    assert len(items) == 100 and items[-1]["id"] == f"zz-bulk{tag}-099"


def test_one_card_has_its_body(client: ApiClient) -> None:
    card = SHIPPED["research-notes"]
    response = client.get("/api/skills/research-notes")
    assert response.status_code == 200
    assert response.json() == {
        "id": card.id,
        "name": card.name,
        "version": card.version,
        "description": card.description,
        "body": card.body,
    }


@pytest.mark.parametrize("skill_id", ["no-such-skill", "CSV-ANALYSIS", "x" * 65, "a%20b", "-csv"])
def test_an_unknown_or_malformed_id_is_404(client: ApiClient, skill_id: str) -> None:
    response = client.get(f"/api/skills/{skill_id}")
    assert response.status_code == 404
    assert response.json() == {"code": "not_found", "message": "skill not found"}
