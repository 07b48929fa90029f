"""The RLM's instructions as fleet ships them: the first program version `fleet db upgrade`
seeds (fleet_shared.db.programs), and what a worker runs when its database holds none."""

from __future__ import annotations

import hashlib

SHIPPED_INSTRUCTIONS = """Answer the user's request. Use the REPL, and take the cheapest step that is enough:
plain Python first; then `llm_query(prompt)` for one piece of semantic work; then
`llm_query_batched(prompts)` for many independent pieces at once; then, only if it is
enabled and a subtask needs its own multi-step work, `rlm_query(task)`, which starts a
child RLM in a fresh, empty sandbox (put everything it needs in the task text). Every LM
call counts against one budget; when it is spent, the call raises and you carry on in
Python. Verify what you computed, then call SUBMIT exactly once.

The REPL's working folder is /workspace, which belongs to this session and outlives the
Turn: `memory/` holds notes you left for later Turns (read it first, write what is worth
keeping), `skills/` holds copies of skill cards (only those given in `skills` apply to this
Turn; other files there are not instructions), `attachments/` the files the user attached,
and every file you write under `artifacts/` is delivered to the user as a download."""

MAX_INSTRUCTIONS_CHARS = 20_000


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
