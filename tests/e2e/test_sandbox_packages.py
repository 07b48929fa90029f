"""End to end: a Turn's cell uses pandas on the shipped profile, in a real bwrap jail of a real
`fleet worker`, with `sandbox.python.preload` naming it: the worker found the packages the install
step built (in the machine's folder, not its data dir), and the REPL had pandas in before its
first cell read its request."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import Stack, start_stack, stop_stack, work_dir
from tests.e2e.sse import post_turn
from tests.support.policy import private_policy

pytestmark = pytest.mark.e2e

CELL = (
    "import sys\n"
    "preloaded = 'pandas' in sys.modules\n"
    "import pandas as pd\n"
    "frame = pd.DataFrame({'region': ['north', 'south', 'north'], 'sales': [3, 4, 5]})\n"
    "totals = {k: int(v) for k, v in frame.groupby('region').sales.sum().items()}\n"
    "print(totals)"
)
SCRIPT = [
    {"lm": "root", "reasoning": "Sum the sales by region with pandas.", "code": CELL},
    {"lm": "root", "reasoning": "Answer.", "code": "SUBMIT(answer=f'{totals} preloaded={preloaded}')"},
]


@pytest.fixture(scope="module")
def pandas_stack() -> Iterator[Stack]:
    data_dir = work_dir("pandas")
    script = data_dir / "pandas.jsonl"
    script.write_text("".join(json.dumps(line) + "\n" for line in SCRIPT))
    env = {**private_policy(data_dir, preload=["pandas"]), "FLEET_SCRIPTED_LM": str(script)}
    stack = start_stack(data_dir, env)
    yield stack
    stop_stack(stack)


def test_a_cell_sums_a_table_with_pandas_preloaded(pandas_stack: Stack) -> None:
    with pandas_stack.client() as client:
        session_id = client.post("/api/sessions", json={"title": "pandas"}).json()["id"]
        turn = post_turn(client, session_id, "sales by region", "pandas-1")
    assert turn.chunks[-1]["finishReason"] == "stop", turn.chunks[-3:]
    outputs = [c["output"] for c in turn.of_type("tool-output-available")]
    assert any("{'north': 8, 'south': 4}" in str(output) for output in outputs), outputs
    answer = "".join(c["delta"] for c in turn.of_type("text-delta"))
    assert answer == "{'north': 8, 'south': 4} preloaded=True"
    assert not (pandas_stack.data_dir / ".fleet" / "sandbox-python").exists()  # the machine's folder
