"""What the Daytona daemon lists, read exactly: times to the nanosecond in either of its layouts,
and Go mode strings told apart (only regular files are files)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fleet_worker.sandbox.daytona.listing import kind_of, stamp_ns

SECOND = 1_767_323_045  # 2026-01-02T03:04:05Z


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-01-02T03:04:05.123456789Z", SECOND * 10**9 + 123_456_789),
        ("2026-01-02T03:04:05.1234Z", SECOND * 10**9 + 123_400_000),
        ("2026-01-02T05:04:05.5+02:00", SECOND * 10**9 + 500_000_000),
        ("2026-01-02T03:04:05Z", SECOND * 10**9),
        ("2026-01-02 03:04:05.123456789 +0000 UTC", SECOND * 10**9 + 123_456_789),  # Go's String()
        ("yesterday", None),
        ("", None),
    ],
)
def test_times_are_read_to_the_nanosecond(text: str, expected: int | None) -> None:
    assert stamp_ns(text) == expected


@pytest.mark.parametrize(
    ("mode", "is_dir", "kind"),
    [
        ("-rw-r--r--", False, "file"),
        ("urwxr-xr-x", False, "file"),  # setuid: a regular file still
        ("drwxr-xr-x", True, "dir"),
        ("Lrwxrwxrwx", False, "other"),
        ("Dcrw-rw-rw-", False, "other"),
        ("prw-r--r--", False, "other"),
        ("Srwxr-xr-x", False, "other"),
        ("rw-", False, "other"),
    ],
)
def test_only_regular_files_are_files(mode: str, is_dir: bool, kind: str) -> None:
    assert kind_of(SimpleNamespace(mode=mode, is_dir=is_dir)) == kind
