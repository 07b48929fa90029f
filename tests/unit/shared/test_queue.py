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


def test_the_job_fleet_writes_is_the_one_arq_would_write() -> None:
    """enqueue_run writes the job itself (one round trip): its bytes must stay arq's, so a worker
    reads it as arq wrote it."""
    from arq.jobs import serialize_job as arq_serialize_job

    from fleet_shared.queue import RUN_TURN, run_turn_job, serialize_job

    expected = arq_serialize_job(RUN_TURN, ("run-1",), {}, None, 1_700_000_000_123, serializer=serialize_job)
    assert run_turn_job("run-1", 1_700_000_000_123) == expected


def test_fleet_gives_a_job_as_long_as_arq_does() -> None:
    from arq.connections import ArqRedis

    from fleet_shared.queue import ARQ_EXPIRES_EXTRA_MS

    assert ArqRedis().expires_extra_ms == ARQ_EXPIRES_EXTRA_MS
