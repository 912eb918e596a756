"""Per-key concurrency limits on a real database: enqueue, the keyed claim, slots and races.

A slot is a claimed row of a (handler, concurrency_key): these tests claim
through the vendor operations directly (``tests.factories.claim``), so
each statement's effect on the table is what is checked. The race test
runs two claimers on their own connections (threads), many rounds.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection, connections

from django_dbworker import EnqueueError, WorkItemHandler, enqueue, enqueue_many
from django_dbworker.checks import concurrency_limit_errors
from django_dbworker.db import operations
from django_dbworker.models import FlowLock, Status, WorkItem
from django_dbworker.registry import registry
from tests.factories import age_heartbeat, claim
from tests.testapp.workers import Keyed, KeyedPair, Noop

pytestmark = pytest.mark.django_db(transaction=True)

HANDLERS = ["keyed", "keyed_pair", "noop"]


def keyed_claim(limit: int = 10, worker: str = "test:1:main") -> list[WorkItem]:
    return claim(limit=limit, handlers=HANDLERS, worker=worker, limited=True)


def claimed_keys() -> list[tuple[str, str | None]]:
    return sorted(
        WorkItem.objects.filter(status=Status.CLAIMED).values_list("handler", "concurrency_key")
    )


def succeed(item: WorkItem) -> None:
    assert item.claim_token is not None
    assert operations().succeed_many([(item.pk, item.claim_token, None)]) == {
        (item.pk, item.claim_token)
    }


# -- enqueue ------------------------------------------------------------------------


def test_enqueue_stores_the_key_and_the_handlers_limit() -> None:
    item = Keyed.enqueue({"key": "a"}, concurrency_key="customer:42")
    row = WorkItem.objects.get(pk=item.pk)
    assert (row.concurrency_key, row.concurrency_limit) == ("customer:42", 1)
    plain = Keyed.enqueue({"key": "b"})
    row = WorkItem.objects.get(pk=plain.pk)
    assert (row.concurrency_key, row.concurrency_limit) == (None, None)


def test_a_key_without_a_handler_limit_is_stored_unlimited() -> None:
    item = Noop.enqueue(concurrency_key="k")
    row = WorkItem.objects.get(pk=item.pk)
    assert (row.concurrency_key, row.concurrency_limit) == ("k", None)


@pytest.mark.parametrize("count", [1, 3, 150])  # 150: PostgreSQL's COPY path
def test_enqueue_many_carries_the_key_and_limit_on_every_row(count: int) -> None:
    items = KeyedPair.enqueue_many([{"n": i} for i in range(count)], concurrency_key="batch")
    rows = WorkItem.objects.filter(pk__in=[i.pk for i in items])
    assert sorted(set(rows.values_list("concurrency_key", "concurrency_limit"))) == [("batch", 2)]
    assert rows.count() == count


def test_module_level_enqueue_functions_take_the_key() -> None:
    one = enqueue("keyed", {"key": "x"}, concurrency_key="k1")
    many = enqueue_many("keyed", [{"key": "y"}], concurrency_key="k2")
    assert WorkItem.objects.get(pk=one.pk).concurrency_key == "k1"
    assert WorkItem.objects.get(pk=many[0].pk).concurrency_key == "k2"


@pytest.mark.parametrize("key", [5, b"k", "", "x" * 201, ["k"], True])
def test_a_bad_concurrency_key_is_refused_writing_nothing(key: Any) -> None:
    with pytest.raises(EnqueueError, match="concurrency_key must be a string of 1 to 200"):
        Keyed.enqueue({"key": "a"}, concurrency_key=key)
    with pytest.raises(EnqueueError, match="concurrency_key must be a string of 1 to 200"):
        Keyed.enqueue_many([{"key": "a"}, {"key": "b"}], concurrency_key=key)
    with pytest.raises(EnqueueError, match="concurrency_key must be a string of 1 to 200"):
        enqueue("keyed", {"key": "a"}, concurrency_key=key)
    assert not WorkItem.objects.exists()


def test_a_key_of_200_characters_is_fine() -> None:
    Keyed.enqueue({"key": "a"}, concurrency_key="k" * 200)
    assert WorkItem.objects.get().concurrency_key == "k" * 200


@pytest.mark.parametrize("limit", [0, -1, "2", True, 1.5, 2**31])
def test_a_bad_concurrency_limit_is_a_check_error_and_refuses_keyed_enqueues(limit: Any) -> None:
    class Bad(WorkItemHandler):
        name = "bad_limit"
        concurrency_limit = limit

    try:
        errors = concurrency_limit_errors([Bad, Keyed, Noop])
        assert [e.id for e in errors] == ["django_dbworker.E020"]
        assert "bad_limit" in errors[0].msg and "concurrency_limit" in errors[0].msg
        with pytest.raises(EnqueueError, match="bad concurrency_limit"):
            Bad.enqueue({}, concurrency_key="k")
        assert not WorkItem.objects.exists()
    finally:
        registry.unregister("bad_limit")


# -- the keyed claim ------------------------------------------------------------------


def test_a_key_at_its_limit_is_skipped_and_rows_behind_it_are_claimed() -> None:
    a = [Keyed.enqueue({"key": f"a{i}"}, concurrency_key="A") for i in range(3)]
    b = Keyed.enqueue({"key": "b"}, concurrency_key="B")
    free = Noop.enqueue()
    got = keyed_claim()
    assert sorted(i.pk for i in got) == sorted([a[0].pk, b.pk, free.pk])
    if connection.vendor != "sqlite":  # SQLite's one statement does not say
        assert getattr(got, "throttled", None) == 2
    # The key is at its limit: nothing more of it, whatever the batch size.
    assert keyed_claim() == []
    assert set(
        WorkItem.objects.filter(pk__in=[a[1].pk, a[2].pk]).values_list("status", "attempts")
    ) == {
        (Status.PENDING, 0)  # waiting is not an attempt
    }
    # Its slot frees when its claimed row finishes: the next one goes.
    succeed(next(i for i in got if i.pk == a[0].pk))
    assert [i.pk for i in keyed_claim()] == [a[1].pk]


def test_a_hot_key_does_not_hold_back_the_rows_behind_it() -> None:
    hot = [Keyed.enqueue({"key": f"h{i}"}, concurrency_key="hot") for i in range(30)]
    others = [Keyed.enqueue({"key": f"o{i}"}, concurrency_key=f"k{i}") for i in range(5)]
    plain = [Noop.enqueue() for _ in range(3)]
    first = keyed_claim(limit=5)
    assert [i.pk for i in first] == [hot[0].pk]
    second = keyed_claim(limit=8)
    assert sorted(i.pk for i in second) == sorted(i.pk for i in others + plain)


def test_a_limit_of_two_allows_two_claimed_rows_of_a_key() -> None:
    rows = [KeyedPair.enqueue({"n": i}, concurrency_key="p") for i in range(5)]
    assert [i.pk for i in keyed_claim()] == [rows[0].pk, rows[1].pk]
    assert keyed_claim() == []
    assert claimed_keys() == [("keyed_pair", "p"), ("keyed_pair", "p")]


def test_the_same_key_of_two_handlers_is_two_keys() -> None:
    k = Keyed.enqueue({"key": "1"}, concurrency_key="same")
    p = KeyedPair.enqueue({"n": 1}, concurrency_key="same")
    assert sorted(i.pk for i in keyed_claim()) == sorted([k.pk, p.pk])


def test_a_key_without_a_limit_is_not_limited() -> None:
    rows = [Noop.enqueue(concurrency_key="free") for _ in range(4)]
    assert sorted(i.pk for i in keyed_claim()) == [r.pk for r in rows]


def test_the_plain_claim_ignores_keys() -> None:
    """Workers whose handlers declare no limit run today's claim, which never looks at keys."""
    rows = [Noop.enqueue(concurrency_key="free") for _ in range(2)]
    assert sorted(i.pk for i in claim(handlers=["noop"])) == [r.pk for r in rows]


def test_the_keyed_claim_takes_flow_locks_only_for_limited_keys() -> None:
    Noop.enqueue()
    Noop.enqueue(concurrency_key="unlimited")
    keyed_claim()
    if connection.vendor != "sqlite":
        assert not FlowLock.objects.exists()
    Keyed.enqueue({"key": "a"}, concurrency_key="A")
    keyed_claim()
    # MySQL locks FlowLock rows; PostgreSQL takes advisory locks instead.
    if connection.vendor == "mysql":
        assert list(FlowLock.objects.values_list("name", flat=True)) == ["key:keyed:A"]


def test_queue_filters_apply_to_the_keyed_claim() -> None:
    a = Keyed.enqueue({"key": "a"}, concurrency_key="A", queue="one")
    Keyed.enqueue({"key": "b"}, concurrency_key="B", queue="two")
    got = claim(handlers=HANDLERS, queues=["one"], limited=True)
    assert [i.pk for i in got] == [a.pk]
    Keyed.enqueue({"key": "c"}, concurrency_key="C", queue="three")
    got = claim(handlers=HANDLERS, queues=["two", "three"], limited=True)
    assert len(got) == 2


# -- slots belong to attempts ---------------------------------------------------------


def test_stale_recovery_frees_the_slot() -> None:
    from django_dbworker import transitions

    first = Keyed.enqueue({"key": "1"}, concurrency_key="A")
    second = Keyed.enqueue({"key": "2"}, concurrency_key="A")
    (held,) = keyed_claim()
    assert held.pk == first.pk
    assert keyed_claim() == []
    age_heartbeat(held, 3600)
    assert transitions.recover_stale(stale_after=60).requeued == 1
    # The recovered row is pending again; the key's slot is free: one of
    # its rows is claimed (recovery may have moved the row's run_after).
    (again,) = keyed_claim()
    assert again.pk in (first.pk, second.pk)
    assert claimed_keys() == [("keyed", "A")]


def test_a_late_fenced_success_frees_no_slot_held_by_the_new_attempt() -> None:
    from django_dbworker import transitions

    first = Keyed.enqueue({"key": "1"}, concurrency_key="A")
    (old,) = keyed_claim()
    age_heartbeat(old, 3600)
    transitions.recover_stale(stale_after=60)
    (new,) = keyed_claim()
    assert new.pk == first.pk and new.claim_token != old.claim_token
    Keyed.enqueue({"key": "2"}, concurrency_key="A")
    # The zombie's success is fenced out: it writes nothing...
    assert old.claim_token is not None
    assert operations().succeed_many([(old.pk, old.claim_token, None)]) == set()
    # ... so the new attempt still holds the key's only slot.
    assert keyed_claim() == []
    assert claimed_keys() == [("keyed", "A")]
    succeed(new)
    assert len(keyed_claim()) == 1


# -- the race for the last slot -------------------------------------------------------


def _claim_on_own_connection(
    barrier: threading.Barrier, worker: str, out: list[list[WorkItem]]
) -> None:
    try:
        connection.ensure_connection()  # connected first: the claims start together
        barrier.wait(10)
        # One row each: both claimers lock a row of the key (SKIP LOCKED
        # gives them different ones), and both see the key's slot free.
        out.append(keyed_claim(limit=1, worker=worker))
    finally:
        connections.close_all()


@pytest.mark.parametrize("limit_handler", [Keyed, KeyedPair])
def test_concurrent_claimers_never_both_take_the_last_slot(
    limit_handler: type[WorkItemHandler],
) -> None:
    limit = limit_handler.concurrency_limit
    assert limit is not None
    rounds, claimers = 40, 3
    for n in range(rounds):
        key = f"race:{n}"
        # Each claimer finds rows of the key ready and one slot free: the
        # other limit - 1 are held. The key was used before (its FlowLock
        # row exists: a new one would serialise the claimers by itself).
        for _ in range(limit):
            limit_handler.enqueue({"key": key}, concurrency_key=key)
        before = keyed_claim(limit=limit)
        assert len(before) == limit
        succeed(before[0])
        for _ in range(4):
            limit_handler.enqueue({"key": key}, concurrency_key=key)
        barrier = threading.Barrier(claimers)
        out: list[list[WorkItem]] = []
        threads = [
            threading.Thread(target=_claim_on_own_connection, args=(barrier, f"racer:{i}", out))
            for i in range(claimers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(out) == claimers, "a claimer failed"
        claimed = WorkItem.objects.filter(
            status=Status.CLAIMED, concurrency_key=key, handler=limit_handler.name
        ).count()
        assert claimed == limit, f"round {n}: {claimed} claimed rows of a key limited to {limit}"
        assert sum(len(got) for got in out) == 1


# -- a worker ---------------------------------------------------------------------------


def test_a_worker_runs_keys_side_by_side_and_one_key_at_a_time(background_worker) -> None:
    from tests.conftest import wait_until
    from tests.factories import assert_no_key_overlaps

    keys, per_key = 6, 5
    for _ in range(per_key):
        for k in range(keys):
            Keyed.enqueue({"key": f"k{k}", "seconds": 0.02}, concurrency_key=f"k{k}")
    # A long poll interval: only the wake-up that each retired attempt
    # gives the claim loop (the ledger's, when its buffer runs low) makes
    # the next item of a key start soon after its slot is freed.
    worker = background_worker(["keyed"], concurrency=4, poll_interval=30.0)
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == keys * per_key,
        timeout=30,
        what="every keyed item to succeed",
    )
    assert assert_no_key_overlaps() > 1
    assert set(WorkItem.objects.values_list("attempts", flat=True)) == {1}
    assert worker is not None


def test_the_docs_example() -> None:
    """docs/topics/flow-control.md "Concurrency limits", with the suite's limit-1 handler."""
    first = Keyed.enqueue({"customer": 42}, concurrency_key="customer:42")
    second = Keyed.enqueue({"customer": 42}, concurrency_key="customer:42")
    other = Keyed.enqueue({"customer": 7}, concurrency_key="customer:7")
    batch = Keyed.enqueue_many([{"customer": 9}] * 3, concurrency_key="customer:9")
    assert (second.concurrency_key, second.concurrency_limit) == ("customer:42", 1)
    got = keyed_claim()
    assert sorted(i.pk for i in got) == sorted([first.pk, other.pk, batch[0].pk])
    assert WorkItem.objects.get(pk=second.pk).status == Status.PENDING


def test_dbworker_stats_lists_the_keys_at_their_limit() -> None:
    from io import StringIO

    from django.core.management import call_command

    from django_dbworker.stats import keys_at_limit

    for _ in range(2):
        Keyed.enqueue({"key": "a"}, concurrency_key="busy")
    KeyedPair.enqueue({"n": 1}, concurrency_key="half")  # 1 of 2 slots: not at its limit
    keyed_claim()
    assert keys_at_limit() == ([{"handler": "keyed", "key": "busy", "claimed": 1, "limit": 1}], 1)
    out = StringIO()
    call_command("dbworker_stats", stdout=out)
    assert "Concurrency keys at their limit" in out.getvalue()
    assert "busy" in out.getvalue()
