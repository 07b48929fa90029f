"""`fleet up`'s startup banner: the URL first, the LM marked when it is scripted, colour only at
a terminal."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from fleet_cli.banner import print_banner, startup_banner
from fleet_shared.config import Settings, load_settings

REPO = Path(__file__).resolve().parents[3]


def settings(profile: str, **env: str) -> Settings:
    base = {"FLEET_CONFIG": str(REPO / "config" / "fleet.toml"), "FLEET_REDIS_URL": "redis://x"}
    return load_settings({**base, "FLEET_PROFILE": profile, **env})


def test_scripted_lm_is_marked_and_the_url_comes_first() -> None:
    text = startup_banner("http://127.0.0.1:8000", settings("offline"), color=False)
    lines = text.splitlines()
    assert lines[0] == "fleet is up: http://127.0.0.1:8000"
    assert "  profile offline" in lines
    assert "  LM      scripted/demo  (scripted: replays demo.jsonl, not a model)" in lines
    assert lines[-1] == "  stop    Ctrl-C"


def test_a_model_is_not_called_scripted() -> None:
    lm_env = {"FLEET_LM_MODEL": "openai/gpt-x", "FLEET_LM_API_KEY": "k", "FLEET_LM_BASE_URL": "http://h/v1"}
    text = startup_banner("http://127.0.0.1:8000", settings("local", **lm_env), color=False)
    assert "  LM      openai/gpt-x" in text.splitlines()
    assert "scripted" not in text


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("stream", "coloured"), [(io.StringIO(), False), (Terminal(), True)])
def test_colour_only_at_a_terminal(stream: io.StringIO, coloured: bool) -> None:
    print_banner("http://127.0.0.1:8000", settings("offline"), stream)
    assert ("\x1b[1m" in stream.getvalue()) is coloured


def test_the_banner_points_to_a_readme_section_that_exists_and_its_curl_lines_take_the_url() -> None:
    from fleet_cli.banner import TRY_A_TURN

    text = startup_banner("http://127.0.0.1:8123", settings("offline"), color=False)
    assert f"'{TRY_A_TURN}', with FLEET=http://127.0.0.1:8123" in text
    readme = (REPO / "README.md").read_text()
    assert f"\n### {TRY_A_TURN}\n" in readme
    section = readme.split(f"### {TRY_A_TURN}", 1)[1]
    assert "localhost:8000" not in readme and "$FLEET/api/sessions" in section
