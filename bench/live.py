"""Lane `live`: a real provider, only when FLEET_LM_MODEL is set (with FLEET_LM_API_KEY and
optionally FLEET_LM_BASE_URL: any OpenAI-compatible endpoint); otherwise skipped with a message.

It runs `fleet eval`'s runner on datasets its seeded generator makes (never downloaded):
`niah` (S-NIAH style: one fact in 100k-1M characters of filler) and `oolong` (OOLONG style:
count or sum one label's rows of a long table), scored `numeric`. The receipt gives, per dataset,
accuracy, $ per query (the Runs' own cost: LiteLLM's price for the model, or
FLEET_BENCH_PRICE_INPUT_PER_MTOK / FLEET_BENCH_PRICE_OUTPUT_PER_MTOK in USD per million tokens),
p50/p95 seconds per query, and LM calls and tokens; the eval receipt of each is kept beside it.
`just bench live --dataset niah` runs one of them.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import harness
from bench import stack as fleet_stack
from bench.harness import Receipt, goal
from fleet_cli.evals.dataset import Metric, load_dataset
from fleet_cli.evals.generate import KINDS, write_dataset
from fleet_cli.evals.runner import Target, run_dataset, write_receipt

PRICE_KEYS = {
    "FLEET_BENCH_PRICE_INPUT_PER_MTOK": "input_usd_per_million_tokens",
    "FLEET_BENCH_PRICE_OUTPUT_PER_MTOK": "output_usd_per_million_tokens",
}


def config_text() -> str:
    base_url = '\nbase_url_env = "FLEET_LM_BASE_URL"' if os.environ.get("FLEET_LM_BASE_URL") else ""
    key = '\napi_key_env = "FLEET_LM_API_KEY"' if os.environ.get("FLEET_LM_API_KEY") else ""
    prices = "".join(
        f"\n{name} = {float(os.environ[env])}" for env, name in PRICE_KEYS.items() if os.environ.get(env)
    )
    lm = f'model_env = "FLEET_LM_MODEL"{key}{base_url}{prices}\nnum_retries = 2'
    template = fleet_stack.CONFIG_TEMPLATE.format(script="", concurrency=4, heartbeat_seconds=10)
    scripted = template.split("[profiles.bench.llm.root]")[0]
    rest = template.split("[profiles.bench.rlm]")[1]
    lms = f"[profiles.bench.llm.root]\n{lm}\n\n[profiles.bench.llm.sub]\n{lm}\n\n"
    text = f"{scripted}{lms}[profiles.bench.rlm]{rest}"
    return text.replace("turn_timeout_seconds = 600", "turn_timeout_seconds = 900")


def run(
    *, quick: bool = False, dataset: str | None = None, rows: int | None = None, seed: int = 7
) -> dict[str, Any]:
    kinds = [dataset] if dataset else list(KINDS)
    rows = rows or (2 if quick else 10)
    smallest, largest = (20_000, 50_000) if quick else (100_000, 1_000_000)
    receipt = Receipt(
        "live",
        {"datasets": kinds, "rows": rows, "chars": [smallest, largest], "seed": seed,
         "model": os.environ.get("FLEET_LM_MODEL"),
         "base_url_set": bool(os.environ.get("FLEET_LM_BASE_URL"))},
    )  # fmt: skip
    if not os.environ.get("FLEET_LM_MODEL"):
        receipt.skipped = ("set FLEET_LM_MODEL (and FLEET_LM_API_KEY, optionally FLEET_LM_BASE_URL) "
                           "to run the live lane against a real provider")  # fmt: skip
        return receipt.written()
    folder = Path(tempfile.mkdtemp(prefix="fleet-bench-live-"))
    with fleet_stack.stack(config_text=config_text()) as st:
        st.start(workers=1)
        for kind in kinds:
            path = write_dataset(
                folder / f"{kind}.jsonl", kind, rows, seed, smallest=smallest, largest=largest
            )
            data = load_dataset(path)
            evaluated = run_dataset(
                data, Target(st.url, None, "bench", "bench stack"), concurrency=2,
                default_metric=Metric(name="numeric"), turn_timeout=900,
            )  # fmt: skip
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(receipt.started))
            kept = harness.RECEIPTS / f"live-eval-{kind}-{stamp}.json"
            write_receipt(evaluated, kept)
            totals = evaluated["totals"]
            receipt.figures[kind] = {
                "dataset_sha256": data.sha256,
                **{k: totals[k] for k in ("accuracy", "usd_per_query", "seconds_p50", "seconds_p95",
                                          "lm_calls", "input_tokens", "output_tokens", "failed")},
                "eval_receipt": kept.name,
            }  # fmt: skip
    if all(receipt.figures[k]["usd_per_query"] is None for k in kinds):
        receipt.notes.append("no price known for the model: set FLEET_BENCH_PRICE_*_PER_MTOK for $ per query")
    answered = all(receipt.figures[k]["failed"] == 0 for k in kinds)
    receipt.goals = [
        goal(
            "report",
            "every row answered: accuracy, $ per query and p50/p95 per dataset",
            {k: receipt.figures[k]["accuracy"] for k in kinds},
            answered,
        )
    ]
    return receipt.written()
