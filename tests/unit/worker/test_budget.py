"""The Turn's one LM call budget: atomic admission from many threads, and child slices."""

from __future__ import annotations

import threading

import pytest

from fleet_worker.budget import CallBudget, ChildBudgetExhausted


def test_admission_is_all_or_nothing() -> None:
    budget = CallBudget(5)
    budget.charge(2)  # the root's actions
    assert not budget.admit(4)
    assert budget.used == 2
    assert budget.admit(3) and budget.remaining == 0
    assert not budget.admit(1)


def test_root_actions_are_counted_past_the_limit_and_leave_nothing_for_sub_calls() -> None:
    budget = CallBudget(1)
    budget.charge(1)
    budget.charge(1)
    assert budget.used == 2 and budget.remaining == 0 and not budget.admit(1)
    assert "only 0 of this Turn's 1" in str(budget.refusal(1, "llm_query"))


def test_concurrent_admissions_never_exceed_the_limit() -> None:
    budget = CallBudget(1000)
    admitted: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def claim() -> None:
        barrier.wait()
        for _ in range(500):
            if budget.admit(3):
                with lock:
                    admitted.append(3)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(admitted) == budget.used == 999


def test_a_slice_is_taken_whole_and_its_unused_rest_given_back_once() -> None:
    budget = CallBudget(10)
    budget.charge(3)
    piece = budget.take_slice(5, minimum=2)
    assert piece is not None and piece.limit == 5 and budget.remaining == 2
    piece.charge(1)
    assert piece.admit(2) and not piece.admit(3)
    assert piece.close() == 3
    assert budget.remaining == 4
    piece.close()
    assert budget.remaining == 4


def test_a_slice_is_cut_to_what_is_left_or_refused_below_the_minimum() -> None:
    budget = CallBudget(4)
    budget.charge(1)
    piece = budget.take_slice(10, minimum=2)
    assert piece is not None and piece.limit == 3
    assert budget.take_slice(10, minimum=2) is None


def test_a_childs_root_action_past_its_slice_stops_the_child() -> None:
    piece = CallBudget(5).take_slice(2, minimum=2)
    assert piece is not None
    piece.charge(1)
    piece.charge(1)
    with pytest.raises(ChildBudgetExhausted):
        piece.charge(1)
