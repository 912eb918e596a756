"""Workers that claim alike share a wake-up turn; others take turns apart (worker/wakeup.py)."""

from __future__ import annotations

from django_dbworker.worker.wakeup import claim_group


def test_the_same_queues_and_handlers_in_any_order_are_one_group() -> None:
    assert claim_group(["b", "a"], ["y", "x"]) == claim_group(["a", "b"], ["x", "y"])
    assert claim_group(None, ["x"]) == claim_group([], ["x"])  # every queue


def test_other_queues_or_other_handlers_are_another_group() -> None:
    # A wake-up must never go only to a worker that cannot claim its row.
    groups = {
        claim_group(None, ["x"]),
        claim_group(["a"], ["x"]),
        claim_group(None, ["x", "y"]),  # another release of the code
        claim_group(["a", "b"], ["x"]),
    }
    assert len(groups) == 4
