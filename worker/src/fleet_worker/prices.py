"""What a Turn's LM tokens cost in USD: the config's price for an LM when it sets one, else
LiteLLM's price map. The map is the copy bundled with the litellm package dspy depends on, read
as data at the worker's start (litellm is not imported, nothing is fetched). A model with no
known price (the scripted LM, a model the map does not know) costs `None`, never 0."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from fleet_shared.config import ResolvedLM, Settings

log = structlog.get_logger(__name__)
PRICE_MAP_FILE = "model_prices_and_context_window_backup.json"  # in the litellm package
PER_MILLION = 1_000_000
DIGITS = 10  # dollars to 1e-10: no float noise in the stream


@dataclass(frozen=True)
class Price:
    input_per_token: float
    output_per_token: float

    def of(self, prompt_tokens: int, completion_tokens: int) -> float:
        return prompt_tokens * self.input_per_token + completion_tokens * self.output_per_token


def litellm_price_map() -> Mapping[str, Any]:
    """LiteLLM's bundled price map, or {} (and a warning) when it cannot be read."""
    spec = importlib.util.find_spec("litellm")  # finds the package without importing it
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        try:
            found = json.loads((Path(folder) / PRICE_MAP_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(found, dict):
            return found
    log.warning("prices.map_unavailable", file=PRICE_MAP_FILE)
    return {}


def map_price(price_map: Mapping[str, Any], model: str) -> Price | None:
    """The model's entry as named (`gemini/gemini-2.0-flash`), or without its provider prefix
    when the entry is that provider's (`openai/gpt-4o-mini` is the map's `gpt-4o-mini`)."""
    provider, _, bare = model.partition("/")
    for name, owner in ((model, None), (bare, provider)):
        entry = price_map.get(name) if name else None
        if not isinstance(entry, dict) or (owner is not None and entry.get("litellm_provider") != owner):
            continue
        prices = entry.get("input_cost_per_token"), entry.get("output_cost_per_token")
        if all(isinstance(p, int | float) and not isinstance(p, bool) and p >= 0 for p in prices):
            return Price(float(prices[0]), float(prices[1]))  # type: ignore[arg-type]
    return None


@dataclass(frozen=True)
class PriceBook:
    """The price of each configured LM, resolved once: a Turn's models are these."""

    prices: Mapping[str, Price | None]

    @classmethod
    def of(cls, settings: Settings) -> PriceBook:
        lms = [settings.root_lm, settings.sub_lm]
        needs_map = any(not lm.scripted and lm.price is None for lm in lms)
        price_map = litellm_price_map() if needs_map else {}
        prices: dict[str, Price | None] = {}
        for lm in lms:  # root and sub may be one model: its usage is one entry, at the config's price
            if lm.name not in prices or lm.price is not None:
                prices[lm.name] = price_of(lm, price_map)
        return cls(prices)

    def cost(self, model: str, prompt_tokens: int, completion_tokens: int) -> float | None:
        price = self.prices.get(model)
        return None if price is None else round(price.of(prompt_tokens, completion_tokens), DIGITS)


def price_of(lm: ResolvedLM, price_map: Mapping[str, Any]) -> Price | None:
    if lm.scripted:
        return None
    if lm.price is not None:
        return Price(lm.price[0] / PER_MILLION, lm.price[1] / PER_MILLION)
    return map_price(price_map, lm.name)


NO_PRICES = PriceBook({})
