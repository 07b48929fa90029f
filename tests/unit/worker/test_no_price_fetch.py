"""A worker never fetches litellm's model price list from the internet: importing litellm
through the worker uses the list litellm ships, at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json
import fleet_worker  # noqa: F401
import litellm  # noqa: F401
from litellm.litellm_core_utils.get_model_cost_map import _cost_map_source_info as source
print(json.dumps({"source": source.source, "forced": source.is_env_forced}))
"""


def test_importing_litellm_through_the_worker_fetches_nothing() -> None:
    env = {k: v for k, v in os.environ.items() if k != "LITELLM_LOCAL_MODEL_COST_MAP"}
    probe = [sys.executable, "-c", PROBE]
    done = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["source"] == "local" and found["forced"] is True, (found, done.stderr[-500:])
    assert "fetch" not in done.stderr.lower()
