"""Every private name of dspy that fleet uses, pinned to dspy 3.4 (worker/pyproject.toml) and
checked by `tests/unit/worker/test_dspy_contract.py`, so an upgrade that moves one fails there.

`FleetRLM`: a fresh `dspy.RLM` for every Turn, whose signatures are built once per process.

dspy builds an RLM's action and extract signatures (pydantic model classes) in its constructor,
and derives a new action signature on every iteration when the REPL's runtime differs from the
one assumed at construction, which fleet's always does (its REPL hosts no dspy sub-agents):
worker CPU on every Turn and every iteration for a result that never changes (ADR 0022).
Signature classes are never changed once built (dspy derives new ones), so every RLM of the same
shape can share them; the module instance, its predictors and its state stay per Turn.

This leans on three private methods of `dspy.RLM` (`_build_signatures`,
`_action_signature_for_current_factory` and `_setup_facade`) and the attributes the first sets;
`tests/unit/worker/test_dspy_contract.py` pins them, so a dspy upgrade that moves them fails
there first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import dspy
from dspy.primitives.code_interpreter import resolve_interpreter_factory
from dspy.primitives.facade import CALL_TOOL, CONSTRUCT_TOOL

# The sandbox facade's setup cell (dspy >= 3.4) carries this variable. fleet refuses that cell, so
# no `dspy.Predict/RLM(...)` can be built inside the REPL: a sandboxed dspy.RLM would recurse on
# the session's own workspace without a depth limit, and its calls would bypass the one budget.
FACADE_SETUP_VARIABLE = "__dspy_host_token"
MAX_SHAPES = 64  # distinct (signature, budget, tools, runtime) shapes kept; a worker uses a few
INITIAL_ATTRIBUTES = (
    "_initial_execution_instructions",
    "_initial_sub_agent_rules",
    "_initial_interpreter_rules",
)

_lock = threading.Lock()
_built: dict[tuple[Any, ...], tuple[tuple[Any, Any], tuple[Any, ...]]] = {}
_derived: dict[tuple[Any, ...], Any] = {}


def remember(table: dict[tuple[Any, ...], Any], key: tuple[Any, ...], value: Any) -> Any:
    with _lock:
        if len(table) >= MAX_SHAPES:
            table.pop(next(iter(table)))
        return table.setdefault(key, value)


class FleetRLM(dspy.RLM):  # type: ignore[misc]  # dspy ships no type information
    def _build_signatures(self) -> Any:
        factory = resolve_interpreter_factory(self._interpreter_factory)
        key = (
            self.signature,
            self.max_llm_calls,
            self._format_tool_docs(self._user_tools),
            self._get_execution_instructions(factory),
        )
        known = _built.get(key)
        if known is None:
            signatures = super()._build_signatures()
            initial = tuple(getattr(self, name) for name in INITIAL_ATTRIBUTES)
            known = remember(_built, key, (signatures, initial))
        signatures, initial = known
        for name, value in zip(INITIAL_ATTRIBUTES, initial, strict=True):
            setattr(self, name, value)
        return signatures

    def _action_signature_for_current_factory(self, factory: Callable[[], Any], sub_agent_rules: str) -> Any:
        current = getattr(self.generate_action, "signature", self._action_signature)
        key = (current, self._get_execution_instructions(factory), sub_agent_rules)
        derived = _derived.get(key)
        if derived is None:
            derived = remember(
                _derived, key, super()._action_signature_for_current_factory(factory, sub_agent_rules)
            )
        return derived

    def _setup_facade(self, repl: Any, budget: Any, interpreter_factory: Callable[[], Any]) -> str:
        """No dspy sub-agents in fleet's REPL: no facade, and no sub-agent guidance in the prompt.

        dspy would try to install its facade, have the interpreter refuse it (SandboxInterpreter
        does, for a plain dspy.RLM), drop the facade's two tools and log a warning: one warning
        per Turn, for a fact of the deployment."""
        for name in (CONSTRUCT_TOOL, CALL_TOOL):
            repl.tools.pop(name, None)
        return ""
