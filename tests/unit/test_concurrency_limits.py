"""Per-key concurrency limits without a database: the limit's validator, lock names, the fit."""

from __future__ import annotations

from typing import Any

import pytest

from django_dbworker.db.keys import FLOW_LOCK_NAME_MAX, flow_lock_name, within_limits
from django_dbworker.validation import CONCURRENCY_LIMIT_MAX, concurrency_limit_problem


@pytest.mark.parametrize("value", [None, 1, 2, 100, CONCURRENCY_LIMIT_MAX])
def test_good_limits(value: Any) -> None:
    assert concurrency_limit_problem(value) is None


@pytest.mark.parametrize("value", [0, -1, True, False, "2", 1.0, 2.5, CONCURRENCY_LIMIT_MAX + 1])
def test_bad_limits(value: Any) -> None:
    problem = concurrency_limit_problem(value)
    assert problem is not None and repr(value) in problem


def test_flow_lock_names_are_readable_when_they_fit_and_digests_otherwise() -> None:
    assert flow_lock_name("sync", "customer:42") == "key:sync:customer:42"
    long = flow_lock_name("h" * 200, "k" * 200)
    assert long.startswith("key#") and len(long) <= FLOW_LOCK_NAME_MAX
    assert long != flow_lock_name("h" * 200, "k" * 199 + "x")


def test_within_limits_takes_candidates_in_claim_order_up_to_each_keys_free_slots() -> None:
    candidates = [
        (1, "h", "a", 1),
        (2, "h", "a", 1),  # a's one slot went to 1
        (3, "h", None, None),  # no key: always
        (4, "h", "b", 2),  # b holds 1 of 2
        (5, "h", "b", 2),  # b full now
        (6, "g", "a", 1),  # the same key of another handler is another key
        (7, "h", "c", 1),  # c is full already
        (8, "h", "free", None),  # a key without a limit: always
    ]
    ids, throttled = within_limits(candidates, {("h", "b"): 1, ("h", "c"): 1})
    assert ids == [1, 3, 4, 6, 8]
    assert throttled == 3
