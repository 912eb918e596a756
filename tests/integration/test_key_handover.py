"""The hand-over: a success write passes its key's slot on (``worker/handover.py``).

On PostgreSQL the success writer's statement records a batch of successes and claims
the next ready rows of the keys they freed (``SUCCEED_AND_TRANSFER``). These tests pin
what that statement may claim (the key's next row in claim order, within the key's
limit, never a row of a paused queue, another queue, a later ``run_after`` or a fenced
success's key), what a worker does with the rows (runs them, one key at a time), and
what happens when the statement fails (the successes are written without it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any
from uuid import UUID, uuid4

import pytest
from django.db.models import Count
from django.utils import timezone

from django_dbworker import WorkItemHandler
from django_dbworker.db import operations
from django_dbworker.models import Status, WorkItem
from django_dbworker.queues import pause_queue
from django_dbworker.worker.handover import TransferFailed
from django_dbworker.worker.identity import worker_id
from django_dbworker.worker.success_writer import SuccessWriter
from tests.conftest import wait_until
from tests.factories import assert_no_key_overlaps, claim

pytestmark = pytest.mark.django_db(transaction=True)
postgres_only = pytest.mark.postgres_only

LIMITS = {"keyed": 1, "keyed_pair": 2}


class KeyedMayFail(WorkItemHandler):
    """One item per key at once; fails (for good) when its payload says so."""

    name = "keyed_may_fail"
    concurrency_limit = 1

    def handle(self, payload: Any) -> None:
        if payload.get("fail"):
            raise ValueError("failed on purpose")


def keyed(key: str, queue: str = "default", **fields: Any) -> WorkItem:
    fields.setdefault("max_attempts", 3)
    return WorkItem.objects.create(
        handler="keyed",
        queue=queue,
        payload={"key": key},
        concurrency_key=key,
        concurrency_limit=1,
        **fields,
    )


def two_claimed_of_a_pair_key(pending: int) -> list[WorkItem]:
    """``pending`` rows of key "a" of ``keyed_pair`` (limit 2), two of them claimed."""
    for _ in range(pending):
        WorkItem.objects.create(
            handler="keyed_pair",
            payload={},
            concurrency_key="a",
            concurrency_limit=2,
            max_attempts=3,
        )
    claimed = claim(limit=10, handlers=["keyed_pair"], limited=True)
    assert len(claimed) == 2
    return claimed


def claim_keyed(limit: int = 10, queues: list[str] | None = None) -> list[WorkItem]:
    return claim(limit=limit, handlers=["keyed"], queues=queues, limited=True)


def succeed_and_transfer(
    items: Sequence[WorkItem],
    *,
    tokens: Sequence[UUID] | None = None,
    limit: int = 100,
    queues: list[str] | None = None,
    limits: dict[str, int] | None = None,
) -> tuple[list[tuple[int, UUID, bool]], list[WorkItem]]:
    outcomes = [
        (item.pk, token, None)
        for item, token in zip(items, tokens or [i.claim_token for i in items], strict=True)
    ]
    return operations().succeed_and_transfer(
        outcomes,  # type: ignore[arg-type]
        limit=limit,
        queues=queues,
        worker="test:1:handover",
        limits=limits or LIMITS,
    )


@postgres_only
def test_a_success_claims_its_keys_next_row_in_claim_order() -> None:
    first = keyed("a")
    later = keyed("a")
    urgent = keyed("a", priority=5)  # enqueued last, claimed first within the key
    other = keyed("b")
    claimed = claim_keyed()
    assert {i.pk for i in claimed} == {urgent.pk, other.pk}
    done = next(i for i in claimed if i.pk == urgent.pk)

    recorded, taken = succeed_and_transfer([done])

    assert recorded == [(done.pk, done.claim_token, False)]
    assert [i.pk for i in taken] == [first.pk], "the key's next row in claim order"
    row = WorkItem.objects.get(pk=first.pk)
    assert (row.status, row.claimed_by, row.attempts) == (Status.CLAIMED, "test:1:handover", 1)
    assert row.claim_token == taken[0].claim_token and taken[0].concurrency_key == "a"
    assert WorkItem.objects.get(pk=done.pk).status == Status.SUCCEEDED
    assert WorkItem.objects.get(pk=later.pk).status == Status.PENDING


@postgres_only
def test_a_fenced_success_passes_no_slot_on() -> None:
    """A late finisher (its row recovered and claimed again) frees no slot of the key."""
    keyed("a")
    keyed("a")
    (held,) = claim_keyed()
    recorded, taken = succeed_and_transfer([held], tokens=[uuid4()])
    assert recorded == [] and taken == []
    assert WorkItem.objects.filter(status=Status.CLAIMED).count() == 1


@postgres_only
def test_a_key_at_a_lowered_limit_gets_no_row_in_place() -> None:
    """Two rows of a key claimed under limit 2; the limit is now 1: one ends, none starts."""
    claimed = two_claimed_of_a_pair_key(pending=3)
    recorded, taken = succeed_and_transfer(claimed[:1], limits={"keyed_pair": 1})
    assert len(recorded) == 1 and taken == []
    recorded, taken = succeed_and_transfer(claimed[1:], limits={"keyed_pair": 1})
    assert len(recorded) == 1 and len(taken) == 1


@postgres_only
def test_keys_of_a_limit_above_one_are_not_handed_over() -> None:
    """The statement counts slots in a snapshot older than its row locks: safe only while
    the row it ends holds its key's only slot (test_attack_s12_handover.py)."""
    claimed = two_claimed_of_a_pair_key(pending=5)
    recorded, taken = succeed_and_transfer(claimed)
    assert len(recorded) == 2 and taken == []
    assert WorkItem.objects.filter(status=Status.CLAIMED).count() == 0


@postgres_only
def test_the_hand_over_claims_nothing_the_claim_would_not() -> None:
    """A paused queue, a queue the worker does not serve, a later run_after, another
    handler's row of the same key name: none is claimed."""
    done = [keyed(k, queue=q) for k, q in (("p", "paused"), ("o", "other"), ("l", "mine"))]
    done += [keyed("n", queue="mine")]
    held = claim(limit=10, handlers=["keyed"], queues=["paused", "other", "mine"], limited=True)
    assert len(held) == len(done)
    keyed("p", queue="paused")
    keyed("o", queue="other")
    keyed("l", queue="mine", run_after=timezone.now() + timedelta(hours=1))
    WorkItem.objects.create(
        handler="keyed_pair",
        queue="mine",
        payload={},
        concurrency_key="n",
        concurrency_limit=2,
        max_attempts=3,
    )
    pause_queue("paused")

    recorded, taken = succeed_and_transfer(held, queues=["paused", "mine"])

    assert len(recorded) == len(held)
    assert taken == []
    assert WorkItem.objects.filter(status=Status.CLAIMED).count() == 0


@postgres_only
def test_the_room_caps_what_is_handed_over() -> None:
    rows = {k: keyed(k) for k in "abc"}
    for k in "abc":
        keyed(k)
    held = claim_keyed()
    assert {i.pk for i in held} == {r.pk for r in rows.values()}
    recorded, taken = succeed_and_transfer(held, limit=2)
    assert len(recorded) == 3 and len(taken) == 2
    assert WorkItem.objects.filter(status=Status.CLAIMED).count() == 2


@postgres_only
def test_a_worker_hands_keys_over_and_runs_each_key_one_at_a_time(
    background_worker: Callable[..., Any],
) -> None:
    """Three keys, four threads: every claim takes all it can (the loop rests), and each
    success's key moves on by hand-over."""
    for n in range(150):
        keyed(f"k{n % 3}")
    worker = background_worker(["keyed"], concurrency=4)
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == 150,
        timeout=60,
        what="every keyed item to succeed",
    )
    assert worker.claimed == 150
    handed_over = worker.handover.handed_over if worker.handover is not None else 0
    assert handed_over > 75, f"most rows came by hand-over, not {handed_over}"
    assert_no_key_overlaps()
    # The first rows by the claim loop, the rest in the success writer's name.
    by = dict(WorkItem.objects.values_list("claimed_by").annotate(n=Count("id")))
    assert by.get(f"{worker_id().rsplit(':', 1)[0]}:dbworker-success-writer") == handed_over, by


@postgres_only
def test_a_key_freed_by_a_failure_is_claimed_without_waiting_for_the_poll(
    background_worker: Callable[..., Any],
) -> None:
    """The claim loop rests after a claim that took all it could (a low buffer does not wake
    it); a key freed by a failure wakes it. With LISTEN on, the loop polls every 120 s
    (no adaptive polls: on SQLite they would find the row anyway)."""
    first = WorkItem.objects.create(
        handler="keyed_may_fail",
        payload={"fail": True},
        concurrency_key="a",
        concurrency_limit=1,
        max_attempts=1,
    )
    second = WorkItem.objects.create(
        handler="keyed_may_fail",
        payload={},
        concurrency_key="a",
        concurrency_limit=1,
        max_attempts=3,
    )
    background_worker(["keyed_may_fail"], poll_interval=120.0, wakeups=True)
    wait_until(
        lambda: WorkItem.objects.get(pk=second.pk).status == Status.SUCCEEDED,
        timeout=30,
        what="the key's second item to run after the first failed (not after a 120 s poll)",
    )
    assert WorkItem.objects.get(pk=first.pk).status == Status.FAILED


class _FailingTransfer:
    keys: dict[int, tuple[str, str]] = {}

    def __call__(self, outcomes: Any) -> Any:
        raise TransferFailed("the hand-over's statement failed") from ValueError("boom")

    def deliver(self) -> None:  # pragma: no cover - never reached
        raise AssertionError("a failed transfer is not delivered")


class _HandOver:
    """The writer's side of ``KeyHandOver``: every batch gets a transfer that fails."""

    def __init__(self) -> None:
        self.failures: list[BaseException] = []

    def prepare(self, items: Any) -> _FailingTransfer:
        return _FailingTransfer()

    def failed(self, transfer: Any, exc: BaseException) -> None:
        self.failures.append(exc)


def test_a_failed_hand_over_still_records_the_successes() -> None:
    WorkItem.objects.create(handler="noop", payload={}, max_attempts=3)
    (item,) = claim(limit=1)
    writer = SuccessWriter()
    handover = _HandOver()
    writer.handover = handover  # type: ignore[assignment]
    writer.start()
    outcome: list[bool] = []
    done = threading.Event()

    def heard(written: Any) -> None:
        outcome.append(written)
        done.set()

    writer.submit(item, None, heard)
    assert done.wait(20)
    writer.close()
    writer.join(10)
    assert outcome == [True]
    assert WorkItem.objects.get(pk=item.pk).status == Status.SUCCEEDED
    assert [str(e) for e in handover.failures] == ["boom"]
