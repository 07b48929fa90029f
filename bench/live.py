"""Lane `live`: a real provider, only when FLEET_LM_MODEL is set (with FLEET_LM_API_KEY and
optionally FLEET_LM_BASE_URL); otherwise skipped with a message. Tasks are generated locally:
needle-in-a-haystack (S-NIAH style: find one fact in long filler) and aggregation (OOLONG
style: count labelled records in a long list). Reports accuracy, $ per Turn from the Runs' token
usage and FLEET_BENCH_PRICE_INPUT_PER_MTOK / FLEET_BENCH_PRICE_OUTPUT_PER_MTOK (USD per million
tokens), and latency p50/p95.
"""

from __future__ import annotations

import os
import random
import re
from typing import Any

from bench import stack as fleet_stack
from bench.harness import Receipt, goal, summary

WORDS = [
    "river", "stone", "lantern", "orchard", "copper", "meadow", "harbor", "violet",
    "signal", "timber", "ember", "glacier", "quarry", "saddle", "thistle", "beacon",
]  # fmt: skip
LABELS = ("alpha", "beta", "gamma", "delta")


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 14))).capitalize() + "."


def niah_task(rng: random.Random, chars: int) -> tuple[str, str]:
    name = f"{rng.choice(WORDS)}-{rng.randint(100, 999)}"
    code = str(rng.randint(100000, 999999))
    filler: list[str] = []
    while sum(len(s) + 1 for s in filler) < chars:
        filler.append(sentence(rng))
    filler.insert(rng.randrange(len(filler)), f"The secret code for {name} is {code}.")
    question = f"What is the secret code for {name}? Reply with the number only."
    return f"{question}\n\n<document>\n{' '.join(filler)}\n</document>", code


def aggregation_task(rng: random.Random, chars: int) -> tuple[str, str]:
    target = rng.choice(LABELS)
    rows: list[str] = []
    count = 0
    while sum(len(r) + 1 for r in rows) < chars:
        label = rng.choice(LABELS)
        count += int(label == target)
        rows.append(f"record {len(rows) + 1}: user{rng.randint(1, 9999)} label={label}")
    question = f"How many records have label={target}? Reply with the number only."
    return f"{question}\n\n<records>\n" + "\n".join(rows) + "\n</records>", str(count)


def config_text() -> str:
    base_url = '\nbase_url_env = "FLEET_LM_BASE_URL"' if os.environ.get("FLEET_LM_BASE_URL") else ""
    key = '\napi_key_env = "FLEET_LM_API_KEY"' if os.environ.get("FLEET_LM_API_KEY") else ""
    lm = f'model_env = "FLEET_LM_MODEL"{key}{base_url}\nnum_retries = 2'
    template = fleet_stack.CONFIG_TEMPLATE.format(script="", concurrency=4, heartbeat_seconds=10)
    scripted = template.split("[profiles.bench.llm.root]")[0]
    rest = template.split("[profiles.bench.rlm]")[1]
    lms = f"[profiles.bench.llm.root]\n{lm}\n\n[profiles.bench.llm.sub]\n{lm}\n\n"
    text = f"{scripted}{lms}[profiles.bench.rlm]{rest}"
    return text.replace("turn_timeout_seconds = 600", "turn_timeout_seconds = 900")


def tokens(usage: dict[str, Any] | None) -> tuple[int, int]:
    """(input, output) tokens summed over the Run's models, whatever their key names."""
    inputs = outputs = 0
    for entry in (usage or {}).values():
        if not isinstance(entry, dict):
            continue
        for key, value in entry.items():
            if isinstance(value, int) and ("prompt" in key or "input" in key):
                inputs += value
            elif isinstance(value, int) and ("completion" in key or "output" in key):
                outputs += value
    return inputs, outputs


def answer_of(url: str, session: str) -> str:
    _, body = fleet_stack.http(url, "GET", f"/api/sessions/{session}/turns?limit=10")
    for item in reversed(body.get("items", [])):
        if item.get("role") == "assistant":
            return " ".join(p.get("text", "") for p in item.get("parts", []) if p.get("type") == "text")
    return ""


def run(
    *, quick: bool = False, tasks: int | None = None, chars: int | None = None, seed: int = 7
) -> dict[str, Any]:
    tasks = tasks or (2 if quick else 10)
    chars = chars or (20_000 if quick else 90_000)
    receipt = Receipt("live", {"tasks_per_kind": tasks, "context_chars": chars, "seed": seed,
                               "model": os.environ.get("FLEET_LM_MODEL")})  # fmt: skip
    if not os.environ.get("FLEET_LM_MODEL"):
        receipt.skipped = ("set FLEET_LM_MODEL (and FLEET_LM_API_KEY, optionally FLEET_LM_BASE_URL) "
                           "to run the live lane against a real provider")  # fmt: skip
        return receipt.written()
    price_in = float(os.environ.get("FLEET_BENCH_PRICE_INPUT_PER_MTOK", "0") or 0)
    price_out = float(os.environ.get("FLEET_BENCH_PRICE_OUTPUT_PER_MTOK", "0") or 0)
    rng = random.Random(seed)
    per_kind: dict[str, dict[str, list[Any]]] = {}
    with fleet_stack.stack(config_text=config_text()) as st:
        st.start(workers=1)
        for _ in range(tasks):
            for kind, make in (("niah", niah_task), ("aggregation", aggregation_task)):
                text, expected = make(rng, chars)
                session = fleet_stack.new_session(st.url)
                result = fleet_stack.post_turn(st.port, session, text, timeout=900)
                answer = answer_of(st.url, session)
                _, run_body = fleet_stack.http(st.url, "GET", f"/api/runs/{result.run_id}")
                tin, tout = tokens(run_body.get("usage") if isinstance(run_body, dict) else None)
                entry = per_kind.setdefault(kind, {"correct": [], "latency": [], "cost": [], "tokens": []})
                entry["correct"].append(expected in re.findall(r"\d+", answer))  # "12" is not in "112"
                entry["latency"].append(result.end_s)
                entry["cost"].append(tin / 1e6 * price_in + tout / 1e6 * price_out)
                entry["tokens"].append([tin, tout])
    for kind, entry in per_kind.items():
        receipt.figures[kind] = {
            "accuracy": round(sum(entry["correct"]) / len(entry["correct"]), 3),
            "latency": summary(entry["latency"]),
            "usd_per_turn": round(sum(entry["cost"]) / len(entry["cost"]), 6),
            "tokens_per_turn": [
                round(sum(t[i] for t in entry["tokens"]) / len(entry["tokens"])) for i in (0, 1)
            ],
        }
    if not (price_in or price_out):
        receipt.notes.append("no prices set (FLEET_BENCH_PRICE_*_PER_MTOK): $ per Turn is 0")
    receipt.goals = [goal("report", "reports accuracy, $ per Turn and p50/p95 latency", True, True)]
    return receipt.written()
