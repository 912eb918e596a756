"""Attacks (session 12) on the hand-over: a success write that claims its keys' next rows
(``SUCCEED_AND_TRANSFER``, ``worker/handover.py``).

Bugs (these tests fail on d4d3543):

1. Over the limit. SUCCEED_AND_TRANSFER counts a key's claimed rows in its statement's
   snapshot, taken before the statement waits for its rows' locks (``l`` ... FOR UPDATE).
   A keyed claim that commits meanwhile counted the ending row as claimed (its end is not
   committed) and took a slot; the transfer, blind to that claim, fills the ended row's
   slot and the other one too (limit 2: three rows claimed). Two tests: a row enqueued
   during the wait, and a row of the key in a queue the transfer does not serve.
2. Ownership. A success write whose commit is unknown (the connection drops after the
   commit) is run again by ``persist``; the rerun records nothing and claims nothing, and
   ``Transfer.taken`` becomes that empty answer: the row the first run claimed, in this
   worker's name, is in no buffer, run by nobody, heartbeated by nobody.

Regression tests (pass): a key freed by a refused result or by a fenced success wakes the
resting loop; a stop while a transfer is in flight leaves no row claimed; no stray output.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from django.db import OperationalError, connections

from django_dbworker import WorkItemHandler
from django_dbworker.db import operations
from django_dbworker.models import Status, WorkItem
from django_dbworker.registry import registry
from django_dbworker.testing import run_until_empty
from django_dbworker.worker import Worker
from tests.conftest import lock_waiters, wait_until
from tests.factories import RowLockHeld, limited_claim, worker_config

pytestmark = pytest.mark.django_db(transaction=True)
postgres_only = pytest.mark.postgres_only


class S12Keyed(WorkItemHandler):
    """One item per key at once; returns a NUL (jsonb refuses it) when ``payload["nul"]``."""

    name = "s12_keyed"
    concurrency_limit = 1

    def handle(self, payload: Any) -> Any:
        return "nul \x00 here" if payload.get("nul") else None


def s12(key: str, **fields: Any) -> WorkItem:
    fields.setdefault("max_attempts", 3)
    fields.setdefault("payload", {})
    return WorkItem.objects.create(
        handler="s12_keyed", concurrency_key=key, concurrency_limit=1, **fields
    )


def pair(key: str, **fields: Any) -> WorkItem:
    fields.setdefault("max_attempts", 3)
    return WorkItem.objects.create(
        handler="keyed_pair", payload={}, concurrency_key=key, concurrency_limit=2, **fields
    )


class InThread:
    """``run`` in a thread of its own (its own connection); the result or error kept."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self.run = run
        self.out: list[Any] = []
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._body, daemon=True)
        self.thread.start()

    def _body(self) -> None:
        try:
            self.out.append(self.run())
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)
        finally:
            connections.close_all()

    def join(self) -> Any:
        self.thread.join(30)
        assert not self.thread.is_alive(), "the thread did not finish"
        assert not self.errors, self.errors
        return self.out[0]


def transfer(
    items: Sequence[WorkItem], *, limits: dict[str, int], queues: list[str] | None = None
) -> tuple[list[tuple[Any, ...]], list[WorkItem]]:
    return operations().succeed_and_transfer(
        [(i.pk, i.claim_token, None) for i in items],  # type: ignore[misc]
        limit=100,
        queues=queues,
        worker="s12:1:handover",
        limits=limits,
    )


def claimed_of_key(handler: str, key: str) -> list[int]:
    return sorted(
        WorkItem.objects.filter(
            handler=handler, concurrency_key=key, status=Status.CLAIMED
        ).values_list("pk", flat=True)
    )


# -- 1. over the limit: the transfer counts in a snapshot older than its lock wait ---------


@postgres_only
def test_a_transfer_that_waited_for_its_row_lock_does_not_over_claim_the_key() -> None:
    """Limit 2. Row A of key k is claimed; B and C wait. The success write of A waits for
    A's row lock (a heartbeat's UPDATE in flight). Meanwhile N of key k is enqueued and a
    keyed claim of another worker takes it: it counts A still claimed, 1 + 1 <= 2. Then
    the write goes on: its ``held`` count is in the statement's snapshot, taken before the
    wait, which sees neither N nor its claim: 1 held - 1 ended = 0, so two slots to fill,
    and it claims B and C. Three rows of the key are claimed under limit 2."""
    a = pair("k")
    pair("k")
    pair("k")
    (held,) = limited_claim(["keyed_pair"], limit=1, worker="s12:1:first")
    assert held.pk == a.pk

    with RowLockHeld(a.pk):
        writer = InThread(lambda: transfer([held], limits={"keyed_pair": 2}))
        wait_until(lambda: lock_waiters() >= 1, what="the success write to wait for A's lock")
        late = pair("k", priority=5)
        other = limited_claim(["keyed_pair"], limit=10, worker="s12:2:other")
        assert [i.pk for i in other] == [late.pk], "the other worker fills the free slot"
    recorded, taken = writer.join()

    assert [r[0] for r in recorded] == [a.pk]
    now_claimed = claimed_of_key("keyed_pair", "k")
    assert len(now_claimed) <= 2, (
        f"key 'k' (limit 2) has {len(now_claimed)} rows claimed at once: {now_claimed}; "
        f"the transfer took {[i.pk for i in taken]}, the other worker {late.pk}"
    )


@postgres_only
def test_a_transfer_that_waited_does_not_over_claim_beside_a_worker_of_another_queue() -> None:
    """The same race without a new row: the other worker serves queue 'q2' only, where the
    key has a row the transfer (queue 'q1') cannot see as claimed in its old snapshot."""
    a = pair("k", queue="q1")
    pair("k", queue="q1")
    pair("k", queue="q1")
    q2 = pair("k", queue="q2", priority=-5)
    (held,) = limited_claim(["keyed_pair"], limit=1, worker="s12:1:first", queues=["q1"])
    assert held.pk == a.pk

    with RowLockHeld(a.pk):
        writer = InThread(lambda: transfer([held], limits={"keyed_pair": 2}, queues=["q1"]))
        wait_until(lambda: lock_waiters() >= 1, what="the success write to wait for A's lock")
        other = limited_claim(["keyed_pair"], limit=10, worker="s12:2:other", queues=["q2"])
        assert [i.pk for i in other] == [q2.pk]
    writer.join()

    now_claimed = claimed_of_key("keyed_pair", "k")
    assert len(now_claimed) <= 2, (
        f"key 'k' (limit 2) has {len(now_claimed)} rows claimed at once: {now_claimed}"
    )


# -- 2. ownership: a retried write after an unknown commit -------------------------------


@postgres_only
def test_rows_handed_over_by_a_write_whose_commit_was_unknown_are_run(
    background_worker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The success write with its hand-over commits, then the connection drops before the
    answer (a transient error): ``persist`` runs the write again, which records nothing
    (A already succeeded) and claims nothing, and ``Transfer.taken`` is replaced by that
    empty answer. B, claimed by the first write in this worker's name, is in no buffer:
    never run, never heartbeated, until stale recovery."""
    ops = operations()
    real = type(ops).succeed_and_transfer
    calls: list[list[int]] = []

    def commit_then_drop(*args: Any, **kwargs: Any) -> Any:
        answer = real(ops, *args, **kwargs)
        calls.append([i.pk for i in answer[1]])
        if len(calls) == 1:
            raise OperationalError("server closed the connection unexpectedly")
        return answer

    monkeypatch.setattr(ops, "succeed_and_transfer", commit_then_drop)
    a = s12("k")
    b = s12("k")
    worker = background_worker(["s12_keyed"], concurrency=4, stale_after=600.0)

    wait_until(
        lambda: WorkItem.objects.get(pk=a.pk).status == Status.SUCCEEDED,
        what="A to succeed",
    )
    wait_until(lambda: len(calls) >= 2, what="the write to be retried")
    assert calls[0] == [b.pk], f"the first write handed B over: {calls}"

    def b_done() -> bool:
        return WorkItem.objects.get(pk=b.pk).status == Status.SUCCEEDED

    try:
        wait_until(b_done, timeout=15, what="B to run")
    except pytest.fail.Exception:
        row = WorkItem.objects.get(pk=b.pk)
        pytest.fail(
            f"B (handed over by a write retried after an unknown commit) is {row.status}, "
            f"claimed by {row.claimed_by!r}, and not in the worker's ledger "
            f"({len(worker.ledger)} attempts in flight): nobody owns it"
        )


# -- 3. wake-ups: a freed key that no transfer passed on --------------------------------


@postgres_only
def test_a_key_freed_by_a_refused_result_is_claimed_without_waiting_for_the_poll(
    background_worker: Callable[..., Any],
) -> None:
    """A's result is refused by the database (jsonb cannot hold NUL): its success write,
    with the hand-over, fails; written again without it, A is refused and recorded as a
    failure, which frees the key. But ``prepare`` put A's id among the rows a transfer
    dealt with (``_dealt``) and nothing takes it out: A's retirement is 'quiet', the
    resting claim loop is not woken, and B of the same key waits for the 120 s poll."""
    a = s12("k", payload={"nul": True}, max_attempts=1)
    b = s12("k")
    # LISTEN on: no adaptive polls (which would find B anyway), the loop polls every 120 s.
    worker = background_worker(["s12_keyed"], poll_interval=120.0, wakeups=True)
    wait_until(
        lambda: WorkItem.objects.get(pk=a.pk).status == Status.FAILED,
        what="A's refused result to be recorded as a failure",
    )
    wait_until(
        lambda: WorkItem.objects.get(pk=b.pk).status == Status.SUCCEEDED,
        timeout=20,
        what="B (same key) to run after A's refused result freed the key, not after the poll",
    )
    assert worker.handover is not None and not worker.handover.broken, (
        "a result the database refuses must not stop the hand-overs"
    )


BLOCK_STARTED = threading.Event()
BLOCK_PROCEED = threading.Event()


class S12Blocking(WorkItemHandler):
    """One item per key at once; waits for the test when its payload says ``block``."""

    name = "s12_blocking"
    concurrency_limit = 1

    def handle(self, payload: Any) -> None:
        if payload.get("block"):
            BLOCK_STARTED.set()
            assert BLOCK_PROCEED.wait(30)


@postgres_only
def test_a_key_freed_by_a_fenced_success_is_claimed_without_waiting_for_the_poll(
    background_worker: Callable[..., Any],
) -> None:
    """A runs; meanwhile its row is recovered as stale (back to pending: a claim is
    needed). A's success is fenced. Its id was put in ``_dealt`` by ``prepare``: the
    retirement wakes nothing, and A (pending again, claimable by this idle worker) waits
    for the 120 s poll."""
    from tests.factories import steal_claim

    BLOCK_STARTED.clear()
    BLOCK_PROCEED.clear()
    try:
        a = WorkItem.objects.create(
            handler="s12_blocking",
            payload={"block": True},
            concurrency_key="k",
            concurrency_limit=1,
            max_attempts=3,
        )
        background_worker(["s12_blocking"], poll_interval=120.0, wakeups=True)
        assert BLOCK_STARTED.wait(20), "A did not start"
        steal_claim(a.pk)
        WorkItem.objects.filter(pk=a.pk).update(payload={})  # its next run does not block
        BLOCK_PROCEED.set()
        wait_until(
            lambda: WorkItem.objects.get(pk=a.pk).status == Status.SUCCEEDED,
            timeout=20,
            what="A, recovered while it ran (its success fenced), to be claimed again and "
            "run without waiting for the 120 s poll",
        )
    finally:
        BLOCK_PROCEED.set()


# -- 4. ownership: a stop while a transfer is in flight ------------------------------------


@postgres_only
def test_a_stop_while_a_transfer_is_in_flight_leaves_no_row_claimed() -> None:
    """A's success write (with its hand-over: the loop rests, B is held back by the key)
    waits for A's row lock; the worker is told to stop; then the write goes on and claims
    B. Once the worker has stopped, B must not be left claimed by it."""
    BLOCK_STARTED.clear()
    BLOCK_PROCEED.clear()
    try:
        a = WorkItem.objects.create(
            handler="s12_blocking",
            payload={"block": True},
            concurrency_key="k",
            concurrency_limit=1,
            max_attempts=3,
        )
        b = WorkItem.objects.create(
            handler="s12_blocking",
            payload={"block": True},
            concurrency_key="k",
            concurrency_limit=1,
            max_attempts=3,
        )
        worker = Worker(
            [registry["s12_blocking"]],
            worker_config(poll_interval=120.0, wakeups=False, stale_after=600.0),
        )
        runner = threading.Thread(target=worker.run, daemon=True)
        runner.start()
        assert BLOCK_STARTED.wait(20), "A did not start"
        assert worker.claim_loop is not None
        wait_until(lambda: worker.claim_loop.rests, what="the claim loop to rest")
        with RowLockHeld(a.pk):
            BLOCK_PROCEED.set()  # A returns; its success write waits for the lock
            wait_until(lambda: lock_waiters() >= 1, what="A's success write to wait")
            worker.stop()
            wait_until(lambda: worker.stopping.is_set(), what="the stop")
        wait_until(
            lambda: WorkItem.objects.get(pk=a.pk).status == Status.SUCCEEDED, what="A's success"
        )
        runner.join(20)
        assert not runner.is_alive(), "the worker did not stop"
        row = WorkItem.objects.get(pk=b.pk)
        assert row.status != Status.CLAIMED, (
            f"B is left claimed by {row.claimed_by!r} after the worker stopped"
        )
        assert worker.handover is not None and worker.handover.handed_over == 1, (
            "the scenario: B came by the hand-over that was in flight at the stop"
        )
    finally:
        BLOCK_PROCEED.set()
        if "worker" in locals():
            worker.stop(immediate=True)
            runner.join(20)


# -- 5. a debugging line left in the claim loop ---------------------------------------------


def test_the_claim_loop_writes_nothing_to_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    """Every claim writes ``CLAIM n=... limit=... rests=...`` to the process's stderr
    (``ClaimLoop.run_once``: ``import sys as _s; _s.stderr.write(...)``)."""
    s12("k")
    run_until_empty(["s12_keyed"])
    err = capfd.readouterr().err
    assert "CLAIM n=" not in err, f"the claim loop wrote to stderr: {err!r}"
