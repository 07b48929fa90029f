"""What a Turn's tokens cost: the config's price for an LM, else LiteLLM's bundled price map
(read as data, never fetched); a model with no known price costs None, never 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet_shared.config import ConfigError, load_settings
from fleet_shared.run_state import RunCommand
from fleet_worker.outcome import Outcome, usage_event
from fleet_worker.prices import Price, PriceBook, litellm_price_map, map_price

REPO = Path(__file__).resolve().parents[3]


def settings_for(model: str, **env: str):  # type: ignore[no-untyped-def]
    return load_settings(
        {
            "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"),
            "FLEET_PROFILE": "local",
            "FLEET_LM_MODEL": model,
            "FLEET_LM_API_KEY": "sk-test",
            "FLEET_LM_BASE_URL": "http://127.0.0.1:9",
            "FLEET_REDIS_URL": "redis://127.0.0.1:9",  # read, never connected to
            **env,
        }
    )


def test_the_bundled_map_prices_a_known_model_by_its_provider_name() -> None:
    price_map = litellm_price_map()
    assert len(price_map) > 1000  # the whole map, from the installed litellm package
    assert map_price(price_map, "openai/gpt-4o-mini") == Price(0.15e-6, 0.6e-6)
    assert map_price(price_map, "openai/no-such-model") is None


def test_a_bare_name_counts_only_for_its_own_provider() -> None:
    price_map = {
        "gpt-x": {"litellm_provider": "openai", "input_cost_per_token": 1e-6, "output_cost_per_token": 2e-6}
    }
    assert map_price(price_map, "openai/gpt-x") == Price(1e-6, 2e-6)
    assert map_price(price_map, "someone-else/gpt-x") is None  # another provider's model, maybe another price
    assert map_price({"m": {"litellm_provider": "p", "input_cost_per_token": "free"}}, "p/m") is None


def test_a_turn_costs_each_priced_model_and_their_sum() -> None:
    book = PriceBook.of(settings_for("openai/gpt-4o-mini"))
    outcome = Outcome(
        RunCommand.COMPLETE,
        "completed",
        lm_usage={"openai/gpt-4o-mini": {"prompt_tokens": 1000, "completion_tokens": 100}},
    )
    usage = usage_event("run", outcome, 5, book)
    assert usage.observed_lm_usage["openai/gpt-4o-mini"].cost_usd == pytest.approx(0.00021)
    assert usage.cost_usd == pytest.approx(0.00021)


def test_the_scripted_lm_and_an_unknown_model_cost_none_not_zero() -> None:
    for settings in (
        settings_for("openai/my-local-model"),
        load_settings(
            {"FLEET_CONFIG": str(REPO / "config" / "fleet.toml"), "FLEET_REDIS_URL": "redis://127.0.0.1:9"}
        ),
    ):
        book = PriceBook.of(settings)
        name = settings.root_lm.name
        outcome = Outcome(
            RunCommand.COMPLETE, "completed", lm_usage={name: {"prompt_tokens": 9, "completion_tokens": 9}}
        )
        usage = usage_event("run", outcome, 5, book)
        assert usage.cost_usd is None and usage.observed_lm_usage[name].cost_usd is None


def priced_config(tmp_path: Path, *prices: str) -> Path:
    config = tmp_path / "fleet.toml"
    lines = ["[profiles.priced]", "[profiles.priced.llm.root]", 'model = "openai/gpt-4o-mini"', *prices]
    config.write_text((REPO / "config" / "fleet.toml").read_text() + "\n" + "\n".join(lines) + "\n")
    return config


def test_the_config_overrides_the_map(tmp_path: Path) -> None:
    prices = ("input_usd_per_million_tokens = 3.0", "output_usd_per_million_tokens = 15.0")
    env = {"FLEET_CONFIG": str(priced_config(tmp_path, *prices)), "FLEET_PROFILE": "priced"}
    book = PriceBook.of(load_settings({**env, "FLEET_REDIS_URL": "redis://127.0.0.1:9"}))
    assert book.cost("openai/gpt-4o-mini", 1_000_000, 100_000) == pytest.approx(4.5)


def test_a_price_needs_both_sides(tmp_path: Path) -> None:
    env = {"FLEET_CONFIG": str(priced_config(tmp_path, "input_usd_per_million_tokens = 1.0"))}
    with pytest.raises(ConfigError, match="input_usd_per_million_tokens and output_usd_per_million_tokens"):
        load_settings({**env, "FLEET_PROFILE": "priced", "FLEET_REDIS_URL": "redis://127.0.0.1:9"})
