"""`fleet_shared.skills`: reading skill cards; every problem is one line naming the file and key."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from fleet_shared.config import load_settings
from fleet_shared.errors import SkillCardError
from fleet_shared.skills import (
    MAX_BODY_BYTES,
    load_skill_cards,
    parse_skill_card,
    selected_skills,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
SHIPPED_SKILLS = REPO_ROOT / "config" / "skills"
FRONT = 'name = "Tables"\nversion = "1.2"\ndescription = "Read tables well."\n'


def card(front: str = FRONT, body: str = "Do the thing.\n") -> bytes:
    return f"+++\n{front}+++\n\n{body}".encode()


def test_a_card_is_its_front_matter_and_body() -> None:
    raw = card(body="# Tables\n\nRead them row by row.\n\n")
    parsed = parse_skill_card(Path("skills/tables.md"), raw)
    assert (parsed.id, parsed.name, parsed.version) == ("tables", "Tables", "1.2")
    assert parsed.description == "Read tables well."
    assert parsed.body == "# Tables\n\nRead them row by row."
    assert parsed.digest == hashlib.sha256(raw).hexdigest()


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("Tables.md", card(), "bad id 'Tables'"),
        ("-tables.md", card(), "bad id '-tables'"),
        ("a_b.md", card(), "bad id 'a_b'"),
        (f"{'a' * 65}.md", card(), "bad id"),
        ("t.md", b"name = 'x'\n", "the first line must be +++"),
        ("t.md", b"+++\nname = 'x'\n", "no closing +++"),
        ("t.md", card(front="name = \n"), "front matter: invalid TOML"),
        ("t.md", card(front='version = "1"\ndescription = "d"\n'), "missing key 'name'"),
        ("t.md", card(front='name = "n"\ndescription = "d"\n'), "missing key 'version'"),
        ("t.md", card(front='name = "n"\nversion = "1"\n'), "missing key 'description'"),
        ("t.md", card(front=FRONT + 'author = "me"\n'), "unknown key 'author'"),
        ("t.md", card(front=FRONT.replace('"1.2"', "1.2")), "version must be a string"),
        ("t.md", card(front=FRONT.replace('"1.2"', "3")), "version must be a string"),
        ("t.md", card(front=FRONT.replace('"Tables"', "7")), "name: Expected `str`"),
        ("t.md", card(front=FRONT.replace('"Tables"', '""')), "name: Expected `str` of length >= 1"),
        ("t.md", card(front=FRONT.replace('"Read tables well."', '"a\\nb"')), "description must be one line"),
        ("t.md", card(front=FRONT.replace('"1.2"', '"  "')), "version is blank"),
        ("t.md", card(body=""), "body: empty"),
        ("t.md", card(body="x" * (MAX_BODY_BYTES + 1)), "body: over 64 KiB"),
        ("t.md", card(body="é" * (MAX_BODY_BYTES // 2 + 1)), "body: over 64 KiB"),  # bytes, not chars
        ("t.md", card() + b"\xff", "not UTF-8"),
    ],
)
def test_a_bad_card_names_the_file_and_the_problem(name: str, raw: bytes, expected: str) -> None:
    path = Path("config/skills") / name
    with pytest.raises(SkillCardError) as info:
        parse_skill_card(path, raw)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert expected in message, message
    assert "\n" not in message


def test_a_body_of_exactly_64_kib_is_accepted() -> None:
    assert len(parse_skill_card(Path("t.md"), card(body="x" * MAX_BODY_BYTES)).body) == MAX_BODY_BYTES


def test_cards_load_sorted_by_id_and_a_missing_folder_has_none(tmp_path: Path) -> None:
    for skill_id in ("zeta", "alpha", "mid-1"):
        (tmp_path / f"{skill_id}.md").write_bytes(card())
    (tmp_path / "README.txt").write_text("not a card")
    (tmp_path / ".draft.md").write_text("an editor's file")
    assert [c.id for c in load_skill_cards(tmp_path)] == ["alpha", "mid-1", "zeta"]
    assert load_skill_cards(tmp_path / "nowhere") == []


def test_one_bad_card_stops_the_load(tmp_path: Path) -> None:
    (tmp_path / "good.md").write_bytes(card())
    (tmp_path / "bad.md").write_bytes(card(front=FRONT + "extra = 1\n"))
    with pytest.raises(SkillCardError, match=r"bad\.md: front matter: unknown key 'extra'"):
        load_skill_cards(tmp_path)


def test_the_shipped_cards_are_valid_and_substantial() -> None:
    cards = load_skill_cards(SHIPPED_SKILLS)
    assert len(cards) >= 4
    for shipped in cards:
        assert 20 <= len(shipped.body.splitlines()) <= 60, shipped.id
        assert len(shipped.description) <= 200, shipped.id


def test_the_skills_folder_is_next_to_the_config_unless_the_env_says_otherwise(tmp_path: Path) -> None:
    env = {"FLEET_CONFIG": str(REPO_ROOT / "config" / "fleet.toml"), "FLEET_REDIS_URL": "redis://x"}
    assert load_settings(env).skills_dir == SHIPPED_SKILLS
    assert load_settings({**env, "FLEET_SKILLS_DIR": str(tmp_path)}).skills_dir == tmp_path


def test_selected_skills_are_read_from_the_user_turns_parts() -> None:
    parts = [
        {"type": "text", "text": "hi"},
        {"type": "data-skill", "data": {"skill_id": "b", "name": "B", "version": "2", "phase": "selected"}},
        {"type": "data-attachment", "data": {"attachment_id": "x"}},
        {"type": "data-skill", "data": {"skill_id": "a", "name": "A", "version": "1", "phase": "selected"}},
        {"type": "data-skill", "data": {"skill_id": "a", "name": "A", "version": "1", "phase": "loaded"}},
    ]
    assert [(s.skill_id, s.version) for s in selected_skills(parts)] == [("b", "2"), ("a", "1")]
