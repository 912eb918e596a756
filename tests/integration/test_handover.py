"""The slot hand-over (``db/handover.py``): a success write claims the freed key's next row.

Through the vendor operations, so each statement's effect on the table is
what is checked. On a vendor without it (``succeed_handing_over``'s
default) the same calls record the successes and claim nothing: the tests
that need a hand-over say so and are PostgreSQL's.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from uuid import uuid4

import pytest
from django.db import connections

from django_dbworker import pause_queue
from django_dbworker.db import operations
from django_dbworker.db.handover import HandOver
from django_dbworker.models import Status, WorkItem
from django_dbworker.worker.handover import SlotHandOver
from tests.factories import claim
from tests.testapp.workers import Keyed, KeyedPair, Noop

pytestmark = pytest.mark.django_db(transaction=True)

WORKER = "test:1:main"
HANDLERS = ["keyed", "keyed_pair", "noop"]


def terms(budget: int = 10, limits: dict[str, int] | None = None, **kw: object) -> HandOver:
    return HandOver(
        limits={"keyed": 1, "keyed_pair": 2} if limits is None else limits,
        queues=kw.get("queues"),  # type: ignore[arg-type]
        worker=str(kw.get("worker", WORKER)),
        budget=budget,
    )


def first_claim(limit: int = 10) -> list[WorkItem]:
    return claim(limit=limit, handlers=HANDLERS, limited=True)


def ended(item: WorkItem, hand_over: HandOver) -> tuple[list[int], list[WorkItem]]:
    assert item.claim_token is not None
    done, handed = operations().succeed_handing_over([(item.pk, item.claim_token, None)], hand_over)
    return [pk for pk, _, _ in done], handed


def key_of(pk: int) -> str | None:
    return WorkItem.objects.get(pk=pk).concurrency_key


hands_over = pytest.mark.postgres_only


@hands_over
def test_a_success_claims_its_keys_next_row_for_the_same_worker() -> None:
    a1, a2, a3 = (Keyed.enqueue({"n": n}, concurrency_key="a") for n in range(3))
    b1 = Keyed.enqueue({}, concurrency_key="b")
    claimed = first_claim()
    assert sorted(i.pk for i in claimed) == [a1.pk, b1.pk]
    item = next(i for i in claimed if i.pk == a1.pk)
    done, handed = ended(item, terms())
    assert done == [a1.pk]
    assert [h.pk for h in handed] == [a2.pk]
    row = WorkItem.objects.get(pk=a2.pk)
    assert row.status == Status.CLAIMED
    assert row.claimed_by == WORKER
    assert row.claim_token == handed[0].claim_token
    assert row.attempts == 1
    assert handed[0].handler == "keyed" and handed[0].payload == {"n": 1}
    assert WorkItem.objects.get(pk=a1.pk).status == Status.SUCCEEDED
    assert WorkItem.objects.get(pk=a3.pk).status == Status.PENDING
    # One slot per key, as before the write.
    assert WorkItem.objects.filter(status=Status.CLAIMED, concurrency_key="a").count() == 1


@hands_over
def test_no_budget_or_no_limited_handler_hands_nothing_over() -> None:
    for _ in range(2):
        Keyed.enqueue({}, concurrency_key="a")
    (item,) = first_claim()
    done, handed = ended(item, terms(budget=0))
    assert done == [item.pk] and handed == []
    Keyed.enqueue({}, concurrency_key="a")
    (item,) = first_claim()  # the second row of "a": its slot is free
    done, handed = ended(item, terms(limits={}))
    assert done == [item.pk] and handed == []
    assert not WorkItem.objects.filter(status=Status.CLAIMED).exists()
    assert WorkItem.objects.filter(status=Status.PENDING).count() == 1


@hands_over
def test_the_budget_caps_the_rows_handed_over_in_claim_order() -> None:
    items = [Keyed.enqueue({"k": k}, concurrency_key=k, priority=9) for k in "abc"]
    for k in "abc":
        Keyed.enqueue({"k": k, "next": True}, concurrency_key=k, priority=5 if k == "b" else 1)
    claimed = claim(limit=3, handlers=["keyed"], limited=True)
    assert {i.pk for i in claimed} == {i.pk for i in items}
    rows = [(i.pk, i.claim_token, None) for i in claimed]
    done, handed = operations().succeed_handing_over(rows, terms(budget=2))  # type: ignore[arg-type]
    assert len(done) == 3
    # b's next row (priority 5) first, then one of priority 1.
    assert [h.priority for h in handed] == [5, 1]
    assert WorkItem.objects.filter(status=Status.CLAIMED).count() == 2


@hands_over
def test_a_lowered_limit_is_not_refilled() -> None:
    for _ in range(3):
        KeyedPair.enqueue({}, concurrency_key="a")
    first, second = claim(limit=5, handlers=["keyed_pair"], limited=True)
    # The handler now says 1: the key holds 2, one ends, and 1 is still held.
    done, handed = ended(first, terms(limits={"keyed_pair": 1}))
    assert done == [first.pk] and handed == []
    done, handed = ended(second, terms(limits={"keyed_pair": 1}))
    assert done == [second.pk] and len(handed) == 1


@hands_over
def test_paused_other_queue_and_not_yet_due_rows_are_not_handed_over() -> None:
    Keyed.enqueue({}, concurrency_key="a", queue="mail")
    Keyed.enqueue({}, concurrency_key="a", queue="mail", run_after=timedelta(hours=1))
    Keyed.enqueue({}, concurrency_key="a", queue="other")
    (item,) = claim(handlers=["keyed"], limited=True, queues=["mail"])
    done, handed = ended(item, terms(queues=["mail"]))
    assert done == [item.pk] and handed == []
    Keyed.enqueue({}, concurrency_key="b", queue="mail")
    Keyed.enqueue({}, concurrency_key="b", queue="mail")
    (item,) = claim(handlers=["keyed"], limited=True, queues=["mail"])
    pause_queue("mail")
    done, handed = ended(item, terms())
    assert done == [item.pk] and handed == []


@hands_over
def test_a_fenced_success_frees_nothing_and_hands_nothing_over() -> None:
    for _ in range(2):
        Keyed.enqueue({}, concurrency_key="a")
    (item,) = first_claim()
    done, handed = operations().succeed_handing_over([(item.pk, uuid4(), None)], terms())
    assert done == [] and handed == []
    assert WorkItem.objects.filter(status=Status.CLAIMED).count() == 1


@hands_over
def test_unkeyed_rows_and_unlimited_handlers_hand_nothing_over() -> None:
    Noop.enqueue_many([{}, {}])
    item = claim(limit=1, handlers=["noop"])[0]
    done, handed = ended(item, terms())
    assert done == [item.pk] and handed == []


@hands_over
def test_hand_overs_racing_keyed_claims_never_exceed_the_limit() -> None:
    """Two threads: one ends and hands over, the other claims keyed, many rounds."""
    keys = [f"k{n}" for n in range(4)]
    for _ in range(30):
        for k in keys:
            Keyed.enqueue({"key": k}, concurrency_key=k)
    stop = threading.Event()
    errors: list[BaseException] = []
    seen_over: list[int] = []

    def check() -> None:
        counts = WorkItem.objects.filter(status=Status.CLAIMED).values_list(
            "concurrency_key", flat=True
        )
        for k in keys:
            n = list(counts).count(k)
            if n > 1:
                seen_over.append(n)

    def ender() -> None:
        try:
            while not stop.is_set():
                held = list(
                    WorkItem.objects.filter(status=Status.CLAIMED, claimed_by="ender").values_list(
                        "pk", "claim_token"
                    )
                )
                if held:
                    operations().succeed_handing_over(
                        [(pk, token, None) for pk, token in held], terms(worker="ender")
                    )
                elif (
                    not claim(handlers=["keyed"], limited=True, worker="ender")
                    and not WorkItem.objects.filter(status=Status.PENDING).exists()
                ):
                    return
                check()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    def claimer() -> None:
        try:
            while not stop.is_set():
                got = claim(handlers=["keyed"], limited=True, worker="claimer")
                check()
                if got:
                    operations().succeed_many([(i.pk, i.claim_token, None) for i in got])  # type: ignore[misc]
                elif not WorkItem.objects.filter(status=Status.PENDING).exists():
                    return
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=ender), threading.Thread(target=claimer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    assert not errors, errors
    assert not seen_over, f"a key held {max(seen_over)} slots"
    assert not WorkItem.objects.exclude(status=Status.SUCCEEDED).exists()


def test_a_vendor_without_it_records_the_success_and_claims_nothing() -> None:
    """On every database the call records; only PostgreSQL hands over."""
    for _ in range(2):
        Keyed.enqueue({}, concurrency_key="a")
    (item,) = first_claim()
    done, handed = ended(item, terms())
    assert done == [item.pk]
    assert WorkItem.objects.get(pk=item.pk).status == Status.SUCCEEDED
    if connections["default"].vendor == "postgresql":
        assert len(handed) == 1
    else:
        assert handed == []


@hands_over
def test_a_worker_hands_its_keys_slots_over_and_never_overlaps_a_key(background_worker) -> None:
    from tests.conftest import wait_until
    from tests.factories import assert_no_key_overlaps

    keys, per_key = 3, 8
    for _ in range(per_key):
        for k in range(keys):
            Keyed.enqueue({"key": f"k{k}", "seconds": 0.01}, concurrency_key=f"k{k}")
    # Four threads over three keys: a thread is free when a key's item ends.
    worker = background_worker(["keyed"], concurrency=4, poll_interval=30.0)
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == keys * per_key,
        timeout=30,
        what="every keyed item to succeed",
    )
    assert assert_no_key_overlaps() > 1
    assert set(WorkItem.objects.values_list("attempts", flat=True)) == {1}
    hand_over = worker.writer.hand_over if worker.writer is not None else None
    assert isinstance(hand_over, SlotHandOver) and hand_over.handed_over > 0
    assert worker.claim_loop is not None and worker.claim_loop.claimed == keys * per_key
