"""Claim semantics, identical on every supported database (run once per leg)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db.models.functions import Now

from django_dbworker.db import operations
from django_dbworker.models import Status, WorkItem
from tests.factories import claim, make_item

# The PgBouncer leg runs these too: claims and transitions through a transaction-mode pooler.
pytestmark = [pytest.mark.django_db, pytest.mark.pgbouncer]


def test_claim_marks_rows_claimed_with_fresh_tokens_and_counts_the_attempt() -> None:
    a, b = make_item(), make_item()
    items = claim(worker="host:42:MainThread")
    assert sorted(i.pk for i in items) == [a.pk, b.pk]
    tokens = {i.claim_token for i in items}
    assert len(tokens) == 2 and None not in tokens
    for row in WorkItem.objects.all():
        assert row.status == Status.CLAIMED
        assert row.attempts == 1
        assert row.claimed_by == "host:42:MainThread"
        assert row.claimed_at is not None and row.heartbeat_at == row.claimed_at
    assert {i.claim_token for i in items} == set(
        WorkItem.objects.values_list("claim_token", flat=True)
    )


def test_claimed_rows_are_never_claimed_again() -> None:
    make_item()
    assert len(claim()) == 1
    assert claim() == []


def test_claim_returns_payload_and_metadata_decoded() -> None:
    make_item(handler="echo", payload={"x": [1, 2, {"y": None}]}, queue="q1", priority=7)
    (item,) = claim()
    assert item.payload == {"x": [1, 2, {"y": None}]}
    assert item.queue == "q1" and item.priority == 7 and item.handler == "echo"
    assert item.max_attempts == 3 and item.attempts == 1
    assert item.status == Status.CLAIMED


def test_claim_order_is_priority_then_due_time_then_id() -> None:
    low = make_item(priority=-5)
    first = make_item(priority=10)
    older = make_item(run_after=Now() - timedelta(seconds=30))
    newer = make_item()
    order = [claim(limit=1)[0].pk for _ in range(4)]
    assert order == [first.pk, older.pk, newer.pk, low.pk]


def test_limit_bounds_the_batch() -> None:
    for _ in range(5):
        make_item()
    assert len(claim(limit=3)) == 3
    assert len(claim(limit=3)) == 2


def test_future_rows_wait_for_their_time_on_the_database_clock() -> None:
    make_item(run_after=Now() + timedelta(hours=1))
    assert claim() == []
    WorkItem.objects.update(run_after=Now() - timedelta(seconds=1))
    assert len(claim()) == 1


def test_claim_filters_by_handler_and_queue() -> None:
    make_item(handler="noop", queue="a")
    b = make_item(handler="echo", queue="b")
    make_item(handler="urgent", queue="b")
    assert [i.pk for i in claim(handlers=["echo"], queues=["b"])] == [b.pk]
    assert claim(handlers=["echo"]) == []
    assert len(claim(handlers=["noop", "urgent"], queues=["a", "b"])) == 2


def test_rows_in_other_states_are_not_claimed() -> None:
    for status in (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED):
        make_item(status=status)
    assert claim() == []


def test_each_claim_gets_a_new_token() -> None:
    item = make_item()
    (first,) = claim()
    WorkItem.objects.filter(pk=item.pk).update(status=Status.PENDING)
    (second,) = claim()
    assert first.claim_token != second.claim_token
    assert second.attempts == 2


def test_a_batch_comes_back_in_claim_order() -> None:
    later = make_item(priority=1, run_after=Now() - timedelta(seconds=10))
    earlier = make_item(priority=1, run_after=Now() - timedelta(seconds=20))
    top = make_item(priority=5)
    low = make_item(priority=-1, run_after=Now() - timedelta(seconds=60))
    plain = make_item()
    assert [i.pk for i in claim(limit=10)] == [top.pk, earlier.pk, later.pk, plain.pk, low.pk]


# -- the keyed claim: per-key concurrency limits ----------------------------------------


def keyed(n: int, key: str, queue: str = "default", handler: str = "keyed", **kw: Any) -> list:
    return [make_item(handler=handler, concurrency_key=key, queue=queue, **kw) for _ in range(n)]


def test_a_keyed_claim_takes_one_row_per_key_of_limit_one_and_skips_held_keys() -> None:
    a = keyed(3, "A")
    b = keyed(2, "B")
    plain = make_item(handler="keyed")
    got = claim(handlers=["keyed"], limited=True)
    assert sorted(i.pk for i in got) == sorted([a[0].pk, b[0].pk, plain.pk])
    assert claim(handlers=["keyed"], limited=True) == []  # both keys held, nothing else
    WorkItem.objects.filter(pk=a[0].pk).update(status=Status.SUCCEEDED)
    assert [i.pk for i in claim(handlers=["keyed"], limited=True)] == [a[1].pk]


def test_a_keyed_claim_caps_the_rows_of_limited_keys() -> None:
    rows = [make_item(handler="keyed", concurrency_key=f"k{n}") for n in range(5)]
    plain = [make_item(handler="keyed") for _ in range(2)]
    got = operations().claim(
        limit=10,
        handlers=["keyed"],
        queues=None,
        worker="test:1:main",
        limits={"keyed": 1},
        keyed_cap=2,
    )
    assert sorted(i.pk for i in got) == sorted([rows[0].pk, rows[1].pk] + [p.pk for p in plain])


def test_a_worker_of_some_queues_leaves_a_key_whose_best_row_waits_elsewhere() -> None:
    """A key's slot goes to its best ready row, whichever queue it is in."""
    low = keyed(2, "K", queue="low")
    high = keyed(1, "K", queue="high", priority=100)
    mine = keyed(1, "M", queue="low")
    assert [i.pk for i in claim(handlers=["keyed"], queues=["low"], limited=True)] == [mine[0].pk]
    assert [i.pk for i in claim(handlers=["keyed"], queues=["high"], limited=True)] == [high[0].pk]
    WorkItem.objects.filter(pk=high[0].pk).update(status=Status.SUCCEEDED)
    assert [i.pk for i in claim(handlers=["keyed"], queues=["low"], limited=True)] == [low[0].pk]


# -- rate limits: a handler's starts in its window ------------------------------------------


def test_a_rate_window_takes_its_starts_then_refuses_with_when_it_frees_up() -> None:
    from django_dbworker.flow.rates import take_start

    ops = operations()
    taken = [take_start(ops, handler="rated", starts=3, period=60.0) for _ in range(4)]
    assert [t is None for t in taken] == [True, True, True, False]
    assert 59.0 < (taken[-1] or 0) <= 61.0
