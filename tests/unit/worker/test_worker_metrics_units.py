"""The worker's metric helpers: LM usage counted under the LM that is calling, queue waits, and
the metrics address from the command line."""

from __future__ import annotations

import contextvars
from datetime import UTC, datetime, timedelta
from pathlib import Path

import msgspec
import pytest
from prometheus_client import REGISTRY

from fleet_shared.config import load_settings
from fleet_shared.errors import ConfigError
from fleet_worker import metrics
from fleet_worker.metrics_http import with_metrics_address

REPO = Path(__file__).resolve().parents[3]


def tokens(model: str, role: str, kind: str) -> float:
    labels = {"model": model, "role": role, "kind": kind}
    return REGISTRY.get_sample_value("fleet_lm_tokens_total", labels) or 0.0


def calls(model: str, role: str) -> float:
    return REGISTRY.get_sample_value("fleet_lm_calls_total", {"model": model, "role": role}) or 0.0


def test_usage_is_counted_under_the_calling_lm() -> None:
    def one_call() -> None:
        metrics.lm_call_started("cfg/model-a", "sub")
        metrics.count_lm_usage("provider/other-name", {"prompt_tokens": 7, "completion_tokens": 3})
        metrics.lm_call_ended()
        metrics.count_lm_usage("cfg/model-a", {"prompt_tokens": 5, "total_tokens": 5, "flag": True})

    before = (tokens("cfg/model-a", "sub", "prompt"), tokens("cfg/model-a", "sub", "completion"))
    before_calls = calls("cfg/model-a", "sub")
    unknown = tokens("cfg/model-a", "unknown", "prompt")
    contextvars.copy_context().run(one_call)
    assert tokens("cfg/model-a", "sub", "prompt") - before[0] == 7
    assert tokens("cfg/model-a", "sub", "completion") - before[1] == 3
    assert calls("cfg/model-a", "sub") - before_calls == 1
    assert tokens("provider/other-name", "sub", "prompt") == 0  # the configured name, not DSPy's
    assert tokens("cfg/model-a", "unknown", "prompt") - unknown == 5  # outside a marked call


def queue_waits() -> float:
    return REGISTRY.get_sample_value("fleet_queue_wait_seconds_count") or 0.0


@pytest.mark.parametrize(
    ("enqueued", "observed"),
    [(timedelta(seconds=-2), 1), (timedelta(seconds=30), 0), (None, 0)],
    ids=["past", "future-clock-skew", "missing"],
)
def test_queue_wait(enqueued: timedelta | None, observed: int) -> None:
    before = queue_waits()
    metrics.observe_queue_wait(None if enqueued is None else datetime.now(UTC) + enqueued)
    assert queue_waits() - before == observed


def test_the_metrics_address_from_the_command_line() -> None:
    settings = load_settings(
        {"FLEET_CONFIG": str(REPO / "config" / "fleet.toml"), "FLEET_REDIS_URL": "redis://x"}
    )
    assert (settings.profile.worker.metrics_host, settings.profile.worker.metrics_port) == ("127.0.0.1", 9100)
    changed = with_metrics_address(settings, "0.0.0.0", 0)
    assert (changed.profile.worker.metrics_host, changed.profile.worker.metrics_port) == ("0.0.0.0", 0)
    assert with_metrics_address(settings, None, None) == settings
    with pytest.raises(ConfigError, match="metrics-port"):
        with_metrics_address(settings, None, 70000)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"metrics_port": 70000}, type(settings.profile.worker))


@pytest.mark.parametrize("host", ["", " ", "\t", " 0.0.0.0", "127.0.0.1\n"])
def test_a_blank_metrics_host_is_rejected_by_the_config(host: str) -> None:
    settings = load_settings(
        {"FLEET_CONFIG": str(REPO / "config" / "fleet.toml"), "FLEET_REDIS_URL": "redis://x"}
    )
    worker_section = type(settings.profile.worker)
    assert msgspec.convert({"metrics_host": "::"}, worker_section).metrics_host == "::"
    with pytest.raises(msgspec.ValidationError, match="metrics_host"):
        msgspec.convert({"metrics_host": host}, worker_section)
