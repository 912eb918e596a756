"""Attacks (session 13) on the hand-over: a success write that claims its keys' next rows
(``SUCCEED_AND_TRANSFER``, ``worker/handover.py``).

Bug found (the test failed on 841a266; fixed since):

- ``test_an_immediate_stop_while_a_transfer_is_in_flight_leaves_no_row_claimed``: an
  immediate stop (a second SIGTERM) while a success write with its hand-over is in flight.
  ``Shutdown.drain`` does not wait for the writer when aborting and releases the ledger's
  leftovers; the write then committed and ``Transfer.deliver`` added the row it claimed to
  a ledger that nothing released any more: the row stayed claimed by an exited process,
  and its pool call took the closed writer for a dead one. Now the ledger refuses rows
  once the leftovers are taken (``Ledger.add``) and the transfer releases them.

Areas tried without a bug found (the other tests pass): keys that are unicode, 200
characters long, or differ from another key only in case, a trailing space or a combining
character; NUL and lone surrogates at enqueue; a handler's ``concurrency_limit`` changed
while a worker runs; run_after, priorities and linked rows (dependents) mixed with plain
keyed rows; a plain stop with a transfer in flight. The worker-level tests watch the
database for a key with more claimed rows than its limit (``KeyWatch``) and the handler
for a row run twice or two runs of one key at once (``Probe``).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections
from django.utils import timezone

from django_dbworker import EnqueueError, WorkItemHandler
from django_dbworker.db import operations
from django_dbworker.models import Status, WorkItem
from tests.conftest import wait_until
from tests.factories import RowLockHeld, limited_claim

pytestmark = pytest.mark.django_db(transaction=True)
postgres_only = pytest.mark.postgres_only


# -- probes ------------------------------------------------------------------------------


class Probe:
    """What the test handlers saw: runs per row, overlapping runs of one key."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: Counter[int] = Counter()
        self.running: Counter[tuple[str, str]] = Counter()
        self.widest: Counter[tuple[str, str]] = Counter()
        self.running_rows: set[int] = set()
        self.twice_at_once: list[int] = []

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def enter(self, handler: str, item: Any) -> None:
        key = (handler, item.concurrency_key)
        with self.lock:
            self.runs[item.pk] += 1
            if item.pk in self.running_rows:
                self.twice_at_once.append(item.pk)
            self.running_rows.add(item.pk)
            self.running[key] += 1
            self.widest[key] = max(self.widest[key], self.running[key])

    def leave(self, handler: str, item: Any) -> None:
        with self.lock:
            self.running_rows.discard(item.pk)
            self.running[(handler, item.concurrency_key)] -= 1


PROBE = Probe()


class S13Keyed(WorkItemHandler):
    """One item per key at once; sleeps ``seconds`` (payload), recorded by ``PROBE``."""

    name = "s13_keyed"
    concurrency_limit = 1

    def handle_item(self, item: Any) -> None:
        PROBE.enter(self.name, item)
        try:
            time.sleep(float((item.payload or {}).get("seconds", 0.0)))
        finally:
            PROBE.leave(self.name, item)


class S13Changing(WorkItemHandler):
    """Starts with limit 1; the tests change ``concurrency_limit`` while a worker runs."""

    name = "s13_changing"
    concurrency_limit: int | None = 1

    def handle_item(self, item: Any) -> None:
        PROBE.enter(self.name, item)
        try:
            time.sleep(float((item.payload or {}).get("seconds", 0.0)))
        finally:
            PROBE.leave(self.name, item)


class KeyWatch:
    """A thread that reads, every few milliseconds, the most claimed rows of each key."""

    def __init__(self, handler: str) -> None:
        self.handler = handler
        self.widest: Counter[str] = Counter()
        self.samples = 0
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._body, daemon=True)

    def _body(self) -> None:
        try:
            while not self.stop.is_set():
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT concurrency_key, count(*) FROM django_dbworker_workitem "
                        "WHERE status = 'claimed' AND handler = %s "
                        "AND concurrency_key IS NOT NULL GROUP BY concurrency_key",
                        [self.handler],
                    )
                    for key, n in cursor.fetchall():
                        self.widest[key] = max(self.widest[key], n)
                self.samples += 1
                time.sleep(0.003)
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)
        finally:
            connections.close_all()

    def __enter__(self) -> KeyWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(10)

    def over(self, limit: int) -> dict[str, int]:
        assert not self.errors, self.errors
        return {k: n for k, n in self.widest.items() if n > limit}


@pytest.fixture
def probe() -> Iterator[Probe]:
    PROBE.reset()
    yield PROBE
    PROBE.reset()


def s13(key: str, handler: str = "s13_keyed", **fields: Any) -> WorkItem:
    fields.setdefault("max_attempts", 3)
    fields.setdefault("payload", {})
    return WorkItem.objects.create(
        handler=handler, concurrency_key=key, concurrency_limit=1, **fields
    )


def transfer(
    items: Sequence[WorkItem], *, queues: list[str] | None = None, limit: int = 100
) -> tuple[list[tuple[Any, ...]], list[WorkItem]]:
    return operations().succeed_and_transfer(
        [(i.pk, i.claim_token, None) for i in items],  # type: ignore[misc]
        limit=limit,
        queues=queues,
        worker="s13:1:handover",
        limits={"s13_keyed": 1},
    )


def status(item: WorkItem) -> str:
    return WorkItem.objects.get(pk=item.pk).status


# -- 1. keys: unicode, 200 characters, case, trailing spaces, combining characters -----------

# Distinct keys that a careless comparison (case folding, trimming, normalisation, a prefix
# of 199 characters) would take for one another.
LOOKALIKES = [
    "ключ-🔑",
    "КЛЮЧ-🔑",
    "ключ-🔑 ",
    " ключ-🔑",
    "e\u0301",  # e + combining acute accent
    "\u00e9",  # é precomposed
    "A",
    "a",
    "A ",
    "Ä",
    "🔑" * 200,
    "🔑" * 199 + "🗝",
    "k" * 200,
    "k" * 199 + "K",
]


@postgres_only
def test_lookalike_keys_hand_over_to_their_own_next_row_only() -> None:
    """Two rows of each of 14 distinct keys that differ only in case, a trailing or leading
    space, normalisation, or their 200th character: every success hands its key's slot to
    its own key's second row, never to a lookalike's."""
    assert len(set(LOOKALIKES)) == len(LOOKALIKES)
    assert all(len(k) <= 200 for k in LOOKALIKES)
    first = {k: s13(k) for k in LOOKALIKES}
    second = {k: s13(k) for k in LOOKALIKES}
    held = limited_claim(["s13_keyed"], limit=100, worker="s13:1:first")
    assert {i.pk for i in held} == {r.pk for r in first.values()}, "one row per key"

    recorded, taken = transfer(held)

    assert len(recorded) == len(LOOKALIKES)
    assert sorted(i.pk for i in taken) == sorted(r.pk for r in second.values())
    for item in taken:
        assert second[item.concurrency_key].pk == item.pk, (
            f"key {item.concurrency_key!r} got row {item.pk}"
        )
    rows = WorkItem.objects.filter(status=Status.CLAIMED).values_list("concurrency_key", flat=True)
    assert sorted(Counter(rows).values()) == [1] * len(LOOKALIKES)


@postgres_only
def test_a_key_without_a_next_row_passes_nothing_to_a_lookalike() -> None:
    """Key "ключ-🔑" ends and has no next row; its lookalikes (case, spaces, a longer key with
    it as a prefix) have pending rows: the hand-over claims none of them."""
    (done_key, *others) = ["ключ-🔑", "КЛЮЧ-🔑", "ключ-🔑 ", "ключ-🔑\u0301", "ключ-🔑ключ-🔑"]
    s13(done_key)
    (held,) = limited_claim(["s13_keyed"], limit=1, worker="s13:1:first")
    pending = [s13(k) for k in others]
    recorded, taken = transfer([held])
    assert [r[0] for r in recorded] == [held.pk]
    assert taken == [], f"claimed rows of other keys: {[i.concurrency_key for i in taken]}"
    assert all(status(r) == Status.PENDING for r in pending)


@postgres_only
def test_a_200_character_key_hands_over_in_claim_order() -> None:
    """A key of 200 four-byte characters: its next row by priority, then run_after, then id;
    a row not yet due is skipped."""
    key = "🔑" * 200
    a = s13(key, priority=9)
    later = s13(key, priority=1)
    due_later = s13(key, priority=5, run_after=timezone.now() + timedelta(hours=1))
    best = s13(key, priority=3)
    (held,) = limited_claim(["s13_keyed"], limit=10, worker="s13:1:first")
    assert held.pk == a.pk
    _, taken = transfer([held])
    assert [i.pk for i in taken] == [best.pk]
    assert status(later) == Status.PENDING and status(due_later) == Status.PENDING


def test_a_nul_or_a_lone_surrogate_in_a_key_is_refused_at_enqueue() -> None:
    """PostgreSQL's text cannot hold NUL: the enqueue says so (EnqueueError), writes nothing."""
    for bad, what in (("ab\x00cd", "NUL"), ("ab\ud800", "surrogate"), ("k" * 201, "201")):
        with pytest.raises(EnqueueError) as raised:
            S13Keyed.enqueue({}, concurrency_key=bad)
        assert "concurrency_key" in str(raised.value), (what, str(raised.value))
        with pytest.raises(EnqueueError):
            S13Keyed.enqueue_many([{}, {}], concurrency_key=bad)
    assert not WorkItem.objects.exists()
    ok = S13Keyed.enqueue({}, concurrency_key="🔑" * 200)
    assert WorkItem.objects.get(pk=ok.pk).concurrency_key == "🔑" * 200


@postgres_only
def test_a_worker_runs_lookalike_keys_one_at_a_time_each(
    background_worker: Callable[..., Any], probe: Probe
) -> None:
    """Six rows of each lookalike key, short handlers, four threads: every row runs once,
    no key ever has two rows claimed or running, and keys move by hand-over."""
    for _ in range(6):
        for key in LOOKALIKES:
            s13(key, payload={"seconds": 0.005})
    total = 6 * len(LOOKALIKES)
    with KeyWatch("s13_keyed") as watch:
        worker = background_worker(["s13_keyed"], concurrency=4)
        wait_until(
            lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == total,
            timeout=60,
            what="every row to succeed",
        )
    assert watch.samples > 10
    assert watch.over(1) == {}, f"keys over their limit of 1: {watch.over(1)}"
    assert set(probe.runs.values()) == {1} and len(probe.runs) == total
    assert max(probe.widest.values()) == 1, probe.widest
    assert not probe.twice_at_once
    assert worker.handover is not None and worker.handover.handed_over > 0


# -- 4. the limit changed while a worker runs --------------------------------------------


@pytest.fixture
def changing_limit() -> Iterator[type[S13Changing]]:
    S13Changing.concurrency_limit = 1
    yield S13Changing
    S13Changing.concurrency_limit = 1


def changing(key: str, n: int, seconds: float) -> list[WorkItem]:
    return [
        WorkItem.objects.create(
            handler="s13_changing",
            payload={"seconds": seconds},
            concurrency_key=key,
            concurrency_limit=1,
            max_attempts=3,
        )
        for _ in range(n)
    ]


def succeeded(handler: str) -> int:
    return WorkItem.objects.filter(handler=handler, status=Status.SUCCEEDED).count()


@postgres_only
def test_a_limit_raised_from_one_to_two_while_running_is_honoured(
    background_worker: Callable[..., Any], probe: Probe, changing_limit: type[S13Changing]
) -> None:
    """Limit 1, hand-overs under way; the class's limit becomes 2: the key never has more
    than 2 rows claimed, and its rows then do run two at a time."""
    changing("k", 40, 0.03)
    changing("j", 40, 0.03)
    with KeyWatch("s13_changing") as watch:
        worker = background_worker(["s13_changing"], concurrency=4)
        wait_until(lambda: succeeded("s13_changing") >= 6, what="some rows to succeed")
        assert watch.over(1) == {}, "over limit 1 before the change"
        assert worker.handover is not None and worker.handover.handed_over > 0
        changing_limit.concurrency_limit = 2
        wait_until(lambda: succeeded("s13_changing") == 80, timeout=60, what="every row")
    assert watch.over(2) == {}, f"over the raised limit of 2: {watch.over(2)}"
    assert max(probe.widest.values()) == 2, f"the raised limit was not used: {probe.widest}"
    assert set(probe.runs.values()) == {1} and not probe.twice_at_once


@postgres_only
def test_a_limit_lowered_from_two_to_one_while_running_is_honoured(
    background_worker: Callable[..., Any], probe: Probe, changing_limit: type[S13Changing]
) -> None:
    """Limit 2 at start; it becomes 1: once the two rows claimed before the change have
    ended, the key never has two rows claimed again (hand-over or claim)."""
    changing_limit.concurrency_limit = 2
    changing("k", 60, 0.02)
    worker = background_worker(["s13_changing"], concurrency=4)
    wait_until(lambda: succeeded("s13_changing") >= 6, what="some rows to succeed")
    changing_limit.concurrency_limit = 1
    # The rows claimed under limit 2 end (a claim in flight at the change, which read limit
    # 2, commits within milliseconds; three more successes take 60 ms at least): once the
    # key is down to one claimed row after that, it must stay at one.
    at_change = succeeded("s13_changing")
    wait_until(
        lambda: (
            succeeded("s13_changing") >= at_change + 3
            and WorkItem.objects.filter(status=Status.CLAIMED).count() <= 1
        ),
        timeout=20,
        what="the key to come down to one claimed row",
    )
    with KeyWatch("s13_changing") as watch:
        wait_until(lambda: succeeded("s13_changing") == 60, timeout=60, what="every row")
    assert watch.over(1) == {}, f"over the lowered limit of 1: {watch.over(1)}"
    assert set(probe.runs.values()) == {1} and not probe.twice_at_once
    assert worker.claimed == 60


@postgres_only
def test_a_limit_removed_while_running_runs_the_rest_unlimited(
    background_worker: Callable[..., Any], probe: Probe, changing_limit: type[S13Changing]
) -> None:
    """Limit 1, then None (the deploy removed it): the rest of the key runs side by side."""
    changing("k", 40, 0.03)
    worker = background_worker(["s13_changing"], concurrency=4)
    wait_until(lambda: succeeded("s13_changing") >= 4, what="some rows to succeed")
    assert max(probe.widest.values()) == 1
    changing_limit.concurrency_limit = None
    wait_until(lambda: succeeded("s13_changing") == 40, timeout=60, what="every row")
    assert max(probe.widest.values()) > 1, "the removed limit still held the key to 1"
    assert set(probe.runs.values()) == {1} and not probe.twice_at_once
    assert worker.claimed == 40


# -- 5. run_after, priorities and linked rows in one success batch ------------------------


@postgres_only
def test_a_mixed_batch_hands_each_key_its_own_next_ready_row() -> None:
    """One success write ends rows of five keys: k1's next is a priority row enqueued last,
    k2's next row is not due (nothing), k3's next row is waiting for a parent (nothing),
    k4's head is locked by another claim (skipped, nothing), k5 has no next row. A row
    with a key of a limit-2 handler and an unkeyed row in the batch claim nothing."""
    from django_dbworker.enqueuing import enqueue

    ends = [s13(k) for k in ("k1", "k2", "k3", "k4", "k5")]
    held = limited_claim(["s13_keyed"], limit=10, worker="s13:1:first")
    assert {i.pk for i in held} == {r.pk for r in ends}
    s13("k1", priority=-1)
    k1_next = s13("k1", priority=4)
    k2_later = s13("k2", run_after=timezone.now() + timedelta(minutes=5))
    parent = WorkItem.objects.create(handler="noop", payload={}, max_attempts=3)
    k3_child = enqueue("s13_keyed", {}, concurrency_key="k3", after=[parent])
    assert WorkItem.objects.get(pk=k3_child.pk).waiting
    k4_next = s13("k4")
    pair = WorkItem.objects.create(
        handler="keyed_pair",
        payload={},
        concurrency_key="k1",
        concurrency_limit=2,
        max_attempts=3,
    )
    WorkItem.objects.create(
        handler="keyed_pair", payload={}, concurrency_key="k1", concurrency_limit=2, max_attempts=3
    )
    (pair_held,) = limited_claim(["keyed_pair"], limit=1, worker="s13:1:pair")
    assert pair_held.pk == pair.pk

    locker = threading.Event()
    release = threading.Event()

    def hold_k4() -> None:
        from django.db import transaction

        try:
            with transaction.atomic():
                list(WorkItem.objects.select_for_update().filter(pk=k4_next.pk))
                locker.set()
                release.wait(20)
        finally:
            connections.close_all()

    thread = threading.Thread(target=hold_k4, daemon=True)
    thread.start()
    assert locker.wait(10)
    try:
        recorded, taken = operations().succeed_and_transfer(
            [(i.pk, i.claim_token, None) for i in [*held, pair_held]],  # type: ignore[misc]
            limit=100,
            queues=None,
            worker="s13:1:handover",
            limits={"s13_keyed": 1, "keyed_pair": 2},
        )
    finally:
        release.set()
        thread.join(10)
    assert len(recorded) == 6
    assert [i.pk for i in taken] == [k1_next.pk]
    assert status(k2_later) == Status.PENDING and status(k4_next) == Status.PENDING
    assert status(k3_child) == Status.PENDING


# -- 2. a stop: an immediate stop (second signal) while a transfer is in flight -------------

BLOCK_STARTED = threading.Event()
BLOCK_PROCEED = threading.Event()


class S13Blocking(WorkItemHandler):
    """One item per key at once; waits for the test when its payload says ``block``."""

    name = "s13_blocking"
    concurrency_limit = 1

    def handle(self, payload: Any) -> None:
        if payload.get("block"):
            BLOCK_STARTED.set()
            assert BLOCK_PROCEED.wait(30)


def resting_worker_running_a() -> tuple[WorkItem, WorkItem, Any, threading.Thread]:
    """A and B of one key (limit 1); a worker (in a thread) runs A, which blocks until
    BLOCK_PROCEED, and its claim loop rests (B waits behind A's key)."""
    from django_dbworker.registry import registry
    from django_dbworker.worker import Worker
    from tests.factories import worker_config

    BLOCK_STARTED.clear()
    BLOCK_PROCEED.clear()
    a, b = (
        WorkItem.objects.create(
            handler="s13_blocking",
            payload={"block": True},
            concurrency_key="k",
            concurrency_limit=1,
            max_attempts=3,
        )
        for _ in range(2)
    )
    worker = Worker(
        [registry["s13_blocking"]],
        worker_config(poll_interval=120.0, wakeups=False, stale_after=600.0),
    )
    runner = threading.Thread(target=worker.run, daemon=True)
    runner.start()
    assert BLOCK_STARTED.wait(20), "A did not start"
    assert worker.claim_loop is not None
    wait_until(lambda: worker.claim_loop.rests, what="the claim loop to rest")
    return a, b, worker, runner


def waiting_statements(like: str) -> int:
    """Statements of this database waiting for a lock whose text matches ``like``."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database() AND query LIKE %s",
            [like],
        )
        (n,) = cursor.fetchone()
    return int(n)


@postgres_only
def test_an_immediate_stop_while_a_transfer_is_in_flight_leaves_no_row_claimed() -> None:
    """A's success write (with its hand-over: the loop rests, B waits behind A's key) waits
    for A's row lock (a heartbeat's UPDATE in flight). The worker is stopped at once
    (``stop(immediate=True)``, a second SIGTERM): the drain does not wait for the writer,
    takes its leftovers (A, being recorded) and releases them, which queues behind the
    write. The write goes first: A succeeds and B is claimed for this worker; the release
    of A finds it recorded. B joins the ledger after the leftovers were taken: nothing
    releases it, the process exits, and B stays claimed by nobody until stale recovery."""
    a, b, worker, runner = resting_worker_running_a()
    try:
        with RowLockHeld(a.pk):
            BLOCK_PROCEED.set()  # A returns; its success write waits for the lock
            wait_until(
                lambda: waiting_statements("%succeeded%") >= 1,
                what="A's success write (with the hand-over) to wait for A's lock",
            )
            worker.stop(immediate=True)
            wait_until(
                lambda: (
                    waiting_statements("%SELECT id FROM django_dbworker_workitem WHERE id%") >= 1
                ),
                what="the stop's release of A to wait behind the write",
            )
        runner.join(20)
        assert not runner.is_alive(), "the worker did not stop"
        assert WorkItem.objects.get(pk=a.pk).status == Status.SUCCEEDED
        assert worker.handover is not None and worker.handover.handed_over == 1, (
            "the scenario: B came by the hand-over that was in flight at the stop"
        )
        row = WorkItem.objects.get(pk=b.pk)
        assert row.status != Status.CLAIMED, (
            f"B is left claimed by {row.claimed_by!r} after the worker stopped "
            f"({len(worker.ledger)} attempt(s) still in its ledger): nobody owns it; "
            f"the watchdog also said {worker.unhealthy!r}"
        )
        assert (row.status, row.attempts) == (Status.PENDING, 0), "released, not counted"
        assert worker.unhealthy is None, worker.unhealthy
    finally:
        BLOCK_PROCEED.set()
        worker.stop(immediate=True)
        runner.join(20)


@postgres_only
def test_a_stop_while_a_transfer_is_in_flight_is_not_taken_for_a_dead_writer() -> None:
    """The same hand-over in flight at a plain stop (one SIGTERM): the drain waits for the
    writer, B joins the ledger and is released with the leftovers, and the stop is clean
    (B's pool call after the stop does not take the closed writer for a dead one).
    Passes: the case the immediate stop above breaks, for contrast."""
    a, b, worker, runner = resting_worker_running_a()
    try:
        with RowLockHeld(a.pk):
            BLOCK_PROCEED.set()
            wait_until(
                lambda: waiting_statements("%succeeded%") >= 1,
                what="A's success write (with the hand-over) to wait for A's lock",
            )
            worker.stop()
            wait_until(lambda: worker.stopping.is_set(), what="the stop")
        runner.join(20)
        assert not runner.is_alive(), "the worker did not stop"
        assert WorkItem.objects.get(pk=a.pk).status == Status.SUCCEEDED
        assert worker.handover is not None and worker.handover.handed_over == 1
        assert WorkItem.objects.get(pk=b.pk).status == Status.PENDING
        assert worker.unhealthy is None, (
            f"a clean stop was taken for a failure: unhealthy = {worker.unhealthy!r}"
        )
    finally:
        BLOCK_PROCEED.set()
        worker.stop(immediate=True)
        runner.join(20)
