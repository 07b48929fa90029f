"""How is_unreachable walks an error. The errors the real drivers raise, at connect and from
statements, are classified in tests/integration/test_db_faults.py."""

from __future__ import annotations

import pytest

from fleet_shared.db.faults import is_unreachable


@pytest.mark.parametrize("error", [ConnectionRefusedError(111, "refused"), TimeoutError()])
def test_a_bare_socket_error_or_timeout_is_unreachable(error: BaseException) -> None:
    assert is_unreachable(error)


def test_a_wrapped_cause_counts() -> None:
    try:
        try:
            raise ConnectionResetError("reset")
        except ConnectionResetError as inner:
            raise RuntimeError("while committing") from inner
    except RuntimeError as outer:
        assert is_unreachable(outer)


def test_an_error_of_the_code_is_not() -> None:
    assert not is_unreachable(ValueError("no"))
