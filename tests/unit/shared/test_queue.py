"""The shared sweep names arq's keys without importing arq: they must stay arq's own."""

from __future__ import annotations

from arq.constants import in_progress_key_prefix, job_key_prefix, result_key_prefix

from fleet_shared.queue import ARQ_IN_PROGRESS_PREFIX, ARQ_JOB_PREFIX, ARQ_RESULT_PREFIX


def test_arq_key_prefixes_match_arq() -> None:
    assert (
        job_key_prefix,
        in_progress_key_prefix,
        result_key_prefix,
    ) == (ARQ_JOB_PREFIX, ARQ_IN_PROGRESS_PREFIX, ARQ_RESULT_PREFIX)
