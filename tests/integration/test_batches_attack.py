"""Attacks on batches and ``after=`` dependencies (issue 22): each test proves a bug.

Every test here FAILS against the core change it attacks (commit cafd496)
on the databases its docstring names (the others run it as a regression
test); its docstring says the scenario, what SPEC "Batches and
dependencies" requires, the cause and a suggested fix. Scenarios that
were tried and held are in ``test_batches_races.py``.
Real databases only; interleavings are forced with threads that own their
connections and explicit transactions, waited on with bounded waits.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import OperationalError, connection, transaction

from django_dbworker import EnqueueError, batch, transitions
from django_dbworker.batches.models import Batch, Dependency
from django_dbworker.models import Status, WorkItem
from tests.conftest import wait_until
from tests.factories import claim, run_retries
from tests.integration.interleave import Held, Racer, lock_waiters, wait_for_lock_waiters
from tests.integration.test_batches_races import callbacks, claimed_batch, succeed
from tests.testapp.workers import AlwaysFail, BatchDone, Noop, Record

pytestmark = pytest.mark.django_db(transaction=True)


# -- operator retry breaks the "after every parent succeeded" rule -------------------


def test_retrying_a_cancelled_waiting_child_does_not_run_it_before_its_parent() -> None:
    """An operator cancels a waiting child, then retries it, while its parent is still pending.

    SPEC: "the item is not claimed until every listed item has succeeded".
    ``QuerySet.retry`` sets the row ``pending`` and due now, but leaves
    ``waiting`` False (``cancel_pending`` cleared it) and ignores the row's
    ``Dependency`` links: the next claim takes the child while its parent
    has not even started. (models.py ``retry``: ``changes`` never looks at
    the parents.) Expected: the retried child waits again (``waiting``,
    run_after in year 9999) until the parent succeeds.
    """
    parent = Record.enqueue({"key": "parent"})
    child = Record.enqueue({"key": "child"}, after=[parent])
    assert WorkItem.objects.get(pk=child.pk).waiting
    child.cancel()
    assert WorkItem.objects.filter(pk=child.pk).retry() == 1
    claimed = {item.pk for item in claim(handlers=["record"])}
    assert child.pk not in claimed, "the child was claimed before its parent succeeded"
    assert claimed == {parent.pk}


def test_retrying_a_cancelled_chain_runs_the_links_in_order() -> None:
    """A chain a -> b -> c whose head failed: b and c were cancelled without running. The
    operator fixes the cause and retries every failed and cancelled row (the admin's
    "Retry" on the Failed/Cancelled filter).

    SPEC: b "is not claimed until every listed item has succeeded". After the
    retry all three are plain due rows: one claim takes a, b and c together,
    so b and c run beside (or before) a. Expected: b and c wait for their
    (now pending again) parents, and run in chain order.
    """
    a = AlwaysFail.enqueue({"key": "a"})
    b = Record.enqueue({"key": "b"}, after=[a])
    c = Record.enqueue({"key": "c"}, after=[b])
    run_retries()
    assert set(WorkItem.objects.filter(pk__in=[b.pk, c.pk]).values_list("status", flat=True)) == {
        Status.CANCELLED
    }
    assert Dependency.objects.filter(child_id__in=[b.pk, c.pk]).count() == 2
    assert WorkItem.objects.filter(status__in=[Status.FAILED, Status.CANCELLED]).retry() == 3
    claimed = {item.pk for item in claim(handlers=["always_fail", "record"])}
    assert claimed == {a.pk}, (
        f"claimed {sorted(claimed)}: b (#{b.pk}) and c (#{c.pk}) were claimed beside "
        f"their parent a (#{a.pk})"
    )


# -- bad after= values -------------------------------------------------------------


@pytest.mark.parametrize("pk", [2**63, -(2**63) - 1, 2**70])
def test_an_id_out_of_the_databases_range_is_an_enqueue_error(pk: int) -> None:
    """``after=[id]`` with an id no row can have (outside the 64-bit range of the id column).

    SPEC: "a parent that does not exist is an EnqueueError". On SQLite the
    lookup ``pk__in=[2**63]`` raises ``OverflowError`` ("Python int too
    large to convert to SQLite INTEGER") from the driver
    (dependencies.py ``lock_parents``), not ``EnqueueError``. Expected: the
    same "do not exist" ``EnqueueError`` as for any other missing id.
    """
    with pytest.raises(EnqueueError, match="do not exist"):
        Record.enqueue({}, after=[pk])
    assert not WorkItem.objects.exists()


# -- REPEATABLE READ sessions: the check after the lock reads an old snapshot --------
#
# completion.py reads the items' states after locking the batch row (the
# dependent's row) and relies on READ COMMITTED for that read to see what the
# lock's previous holder committed. A project whose OPTIONS["isolation_level"]
# is REPEATABLE READ (supported elsewhere: docs/topics/databases.md, the keyed
# claim in docs/topics/flow-control.md) gets transactions whose snapshot was
# taken at their first statement, before the other finisher committed.


def _repeatable_read() -> None:
    """The session a project with ``OPTIONS["isolation_level"] = REPEATABLE READ`` gets."""
    connection.ensure_connection()
    if connection.vendor == "postgresql":
        import psycopg

        connection.connection.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    else:
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        connection.isolation_level = "repeatable read"  # what Django records at connect


@pytest.mark.postgres_only
def test_two_finishers_at_repeatable_read_fire_the_callback() -> None:
    """PostgreSQL, a project at REPEATABLE READ: the last two items of a batch finish together.

    Finisher A writes its success and holds the batch row's lock (seeing B's
    item still claimed). Finisher B writes its success (its snapshot is taken
    by that first statement), waits for the batch row, and once A commits
    reads the items in that old snapshot: A's item still claimed, so it does
    not complete the batch either. No callback until a stale-recovery pass
    sweeps (``completion.sweep``, every ``STALE_AFTER / 4``). SPEC: the
    callback is enqueued exactly once "when the last item of the batch
    reaches a final state, also when workers ... finish concurrently", and
    issue 22: in the same transaction as that final state. Cause:
    ``VendorOperations.ending_transaction`` (db/base.py) is a plain
    ``transaction.atomic`` on PostgreSQL, at the session's level; the keyed
    claim sets READ COMMITTED for itself (postgresql.py ``_claim_keyed``),
    the ending does not. Fix: ``ending_transaction`` sets READ COMMITTED as
    its first statement when it opens the transaction (and refuses, or
    locks differently, inside a caller's stricter transaction).
    """
    batch_id, (a, b) = claimed_batch(2)
    first = Held(lambda: succeed(a))
    second = Racer(lambda: succeed(b), session=_repeatable_read)
    wait_for_lock_waiters(1, second)
    first.release()
    second.outcome()
    assert set(WorkItem.objects.filter(batch_id=batch_id).values_list("status", flat=True)) == {
        Status.SUCCEEDED
    }
    assert len(callbacks(batch_id)) == 1, "both items succeeded and no callback was enqueued"


@pytest.mark.postgres_only
def test_a_fan_in_child_at_repeatable_read_is_released() -> None:
    """PostgreSQL, REPEATABLE READ: a child's two parents succeed together.

    As above, for ``completion._resolve``: the second finisher locks the
    child after the first committed, but reads the parents' states in its
    old snapshot (the other parent still claimed) and leaves the child
    waiting; the first saw the second parent claimed. The child is stuck
    (``waiting``, run_after in 9999) until a sweep. SPEC: the item is not
    claimed until every parent succeeded, and then it is (issue 22:
    wake-ups, not polls, start the next link). Same fix.
    """
    p1 = Record.enqueue({"key": "p1"})
    p2 = Record.enqueue({"key": "p2"})
    child = Record.enqueue({"key": "child"}, after=[p1, p2])
    a, b = sorted(claim(limit=2, handlers=["record"]), key=lambda i: i.pk)
    first = Held(lambda: succeed(a))
    second = Racer(lambda: succeed(b), session=_repeatable_read)
    wait_for_lock_waiters(1, second)
    first.release()
    second.outcome()
    row = WorkItem.objects.get(pk=child.pk)
    assert (row.status, row.waiting) == (Status.PENDING, False), "the child is still waiting"


@pytest.mark.server_db
def test_operator_cancel_of_the_last_item_at_repeatable_read_fires_the_callback() -> None:
    """PostgreSQL and MariaDB, a project at REPEATABLE READ: the admin cancels the last
    pending item of a batch while a worker's success of the other is being committed.

    The worker's ending holds the batch row's lock and sees the pending item;
    the operator's ``cancel`` (models.py ``cancel_pending``: a plain
    ``transaction.atomic``, not ``ending_transaction``) takes its snapshot
    with its first read, waits for the batch row, and then reads the
    worker's item as still claimed. No callback (until a sweep). On MariaDB
    the success writer sets READ COMMITTED for itself (mysql.py
    ``_read_committed``), the operator's cancel does not. Fix: run
    ``cancel_pending``'s transaction through ``ending_transaction`` (READ
    COMMITTED on both vendors; the port ``connect_ending`` can hand it over).
    """
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue({})
        last = Noop.enqueue({})
    (a,) = claim(limit=1, handlers=["noop"])
    finisher = Held(lambda: succeed(a))
    operator = Racer(lambda: WorkItem.objects.filter(pk=last.pk).cancel(), session=_repeatable_read)
    wait_for_lock_waiters(1, operator)
    finisher.release()
    assert operator.outcome() == 1
    assert len(callbacks(b.id)) == 1, "every item ended and no callback was enqueued"


@pytest.mark.mysql_only
def test_an_atomic_handler_finishing_the_last_item_at_repeatable_read_fires_the_callback() -> None:
    """MariaDB, a project at REPEATABLE READ: the batch's last item is an atomic handler's.

    ``atomic = True`` runs ``handle`` and the success write in one
    transaction (execution.py ``_run_and_record``); its first read (here
    the handler's own query) takes the snapshot. The success write's
    ``ending_transaction`` is then nested (mysql.py ``_read_committed``
    keeps the caller's level), so the batch check after the lock reads the
    other item, whose success committed meanwhile, as claimed: no callback
    (until a sweep). Two atomic handlers of one batch finishing together
    miss it the same way without any lock wait. Fix: the batch check must
    not depend on the transaction's snapshot: read the items with a
    locking read (``SELECT ... FOR SHARE`` / ``LOCK IN SHARE MODE`` of
    the batch's live rows), or run the completion step after the atomic
    block in a READ COMMITTED transaction of its own.
    """
    batch_id, (a, x) = claimed_batch(2)

    def atomic_handler_run() -> set[Any]:
        with transaction.atomic():
            WorkItem.objects.filter(batch_id=batch_id).count()  # the handler reads something
            ready.set()
            assert go.wait(30)
            return succeed(x)

    ready, go = threading.Event(), threading.Event()
    atomic = Racer(atomic_handler_run, session=_repeatable_read)
    assert ready.wait(30)
    finisher = Held(lambda: succeed(a))
    go.set()
    wait_for_lock_waiters(1, atomic)
    finisher.release()
    atomic.outcome()
    assert len(callbacks(batch_id)) == 1, "both items succeeded and no callback was enqueued"


# -- pruning: the links outlive their parent for a moment -------------------------


@pytest.mark.server_db
def test_pruning_a_succeeded_parent_never_cancels_its_waiting_child() -> None:
    """A child waits for p1 (succeeded, old enough to prune) and p2 (running). Retention
    prunes p1 while p2's success is written.

    retention.py ``prune`` deletes the batch of work items (its own committed
    statement), then, in another statement, their ``Dependency`` rows. Any
    ending that settles the child between the two (here p2's success; the
    same for ``completion.sweep``) finds a link to a parent that no longer
    exists and cancels the child: "it runs after work item #p1, which no
    longer exists", although p1 succeeded and p2 succeeded. (A pruner killed
    between the two statements leaves the links for good: the child is
    cancelled by whichever ending settles it next.) The window is held open
    here by locking p1's link row, as a slow or killed pruner would. SPEC:
    the item runs once every parent succeeded; a pruned parent had. Fix:
    delete the links before the items, in one transaction with them
    (``transaction.atomic`` around both deletes of a batch).
    """
    from datetime import timedelta

    from django.db.models.functions import Now

    from django_dbworker.retention import prune

    p1 = Record.enqueue({"key": "p1"})
    p2 = Record.enqueue({"key": "p2"})
    child = Record.enqueue({"key": "child"}, after=[p1, p2])
    a, b = sorted(claim(limit=2, handlers=["record"]), key=lambda i: i.pk)
    succeed(a)
    WorkItem.objects.filter(pk=p1.pk).update(finished_at=Now() - timedelta(days=30))
    links = Held(lambda: list(Dependency.objects.select_for_update().filter(parent_id=p1.pk)))
    pruner = Racer(lambda: prune(older_than=timedelta(days=7), statuses=[Status.SUCCEEDED]))
    wait_for_lock_waiters(1, pruner)
    # One transaction deletes the items and their links: p1 is not gone before them.
    assert WorkItem.objects.filter(pk=p1.pk).exists()
    succeed(b)
    links.release()
    assert pruner.outcome() == 1
    row = WorkItem.objects.get(pk=child.pk)
    assert (row.status, row.waiting) == (Status.PENDING, False), (
        f"the child ended {row.status}: {row.last_error}"
    )


# -- the batch block and its context ----------------------------------------------


@pytest.mark.server_db
def test_an_enqueue_in_a_thread_running_the_blocks_context_is_rolled_back_with_it() -> None:
    """Inside a ``batch()`` block, an item is enqueued by a thread that runs a copy of the
    block's context (``contextvars.copy_context().run``; ``asyncio.to_thread`` and
    asgiref's ``sync_to_async(thread_sensitive=False)`` copy it too), then the block
    raises.

    batches.py says "another thread's [enqueue] does not" belong to the
    batch, but the batch is found through a ``ContextVar``, which such
    threads copy: the item gets ``batch_id`` of the open batch, and is
    inserted on that thread's own connection, committed at once (no foreign
    key waits for the uncommitted batch row). The block rolls back: no
    batch, but its item stays, runs, and points to a batch that never
    existed. SPEC: "if the surrounding transaction rolls back, there is no
    batch, no item and no callback". Fix: ``_Open`` records the block's
    thread (or its connection object); ``current_batch_id`` ignores the
    batch, or raises ``EnqueueError``, in any other thread.
    """
    import contextvars

    from django_dbworker.batches.models import Batch

    def block() -> None:
        with batch(on_complete=BatchDone):
            context = contextvars.copy_context()
            Racer(lambda: context.run(Noop.enqueue, {})).outcome()
            raise RuntimeError("the block rolls back")

    with pytest.raises(RuntimeError, match="rolls back"):
        block()
    assert not Batch.objects.exists()
    # The other thread's enqueue is its own (docs/topics/batches.md, "What belongs to
    # a batch"): committed on its own connection, it names no batch.
    leftover = list(WorkItem.objects.values_list("batch_id", flat=True))
    assert leftover == [None], f"rows left naming a rolled-back batch: {leftover}"


def test_a_unique_key_enqueue_in_a_batch_is_refused() -> None:
    """In a ``batch()`` block, ``enqueue(unique_key=k)`` could find a live row of that key
    and return it (SPEC "Unique work"), a row not in the batch: the block would seal an
    empty batch and enqueue the callback at once while its one item is pending. So the
    combination is an ``EnqueueError`` (nothing is written; the block rolls back)."""
    existing = Noop.enqueue({}, unique_key="k")
    with (
        pytest.raises(EnqueueError, match="unique_key cannot be used inside a batch"),
        batch(on_complete=BatchDone),
    ):
        Noop.enqueue({}, unique_key="k")
    assert list(WorkItem.objects.values_list("pk", flat=True)) == [existing.pk]
    assert not Batch.objects.exists()


# -- faults -----------------------------------------------------------------------


def _kill_lock_waiter() -> None:
    """Kill the connection that waits for a row lock (as a failover or a DBA would)."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
        else:
            cursor.execute(
                "SELECT trx_mysql_thread_id FROM information_schema.innodb_trx "
                "WHERE trx_state = 'LOCK WAIT'"
            )
            for (pid,) in cursor.fetchall():
                try:
                    cursor.execute(f"KILL CONNECTION {int(pid)}")
                except OperationalError as exc:
                    if exc.args[0] != 1094:  # Unknown thread id: it ended by itself meanwhile
                        raise


@pytest.mark.server_db
def test_a_lost_connection_after_a_parents_success_does_not_leave_its_child_waiting() -> None:
    """A child is enqueued ``after=[p]`` while p runs (p's claim did not know it has
    dependents). The success writer records p; its connection dies before the child is
    released.

    transitions.py ``succeed``, the "not linked" path: the success is one
    autocommitted statement, and the dependents that the row gained after
    its claim are settled in a second transaction. When the connection is
    lost between the two, the writer retries (``persist``); the retried
    write matches no claimed row, ``already_succeeded`` confirms the
    success, and nothing settles the child: it stays ``waiting`` with
    run_after in year 9999 until a stale-recovery pass sweeps (every
    ``STALE_AFTER / 4`` seconds). SPEC: the item runs once its parents
    succeeded (issue 22: wake-ups, not polls). The loss is forced here by
    holding the child's row lock and killing the writer's connection while
    it waits for it. Fix: settle the rows that ``already_succeeded``
    confirms (``completion.propagate_rows`` is idempotent), or write the
    success of a row with dependents in the ending's transaction always
    (``succeed_rows`` of ``has_dependents`` rows can be re-run under
    ``ending_transaction`` when it returns them).
    """
    from django_dbworker.worker.success_writer import InlineSuccessWriter

    parent = Record.enqueue({"key": "p"})
    (running,) = claim(handlers=["record"])
    child = Record.enqueue({"key": "c"}, after=[parent])
    held = Held(lambda: list(WorkItem.objects.select_for_update().filter(pk=child.pk)))
    writer = Racer(lambda: InlineSuccessWriter(using="default").record(running, None))
    wait_for_lock_waiters(1, writer)
    _kill_lock_waiter()
    held.release()
    assert writer.outcome() is True  # the success is recorded, and the writer says so
    assert WorkItem.objects.get(pk=parent.pk).status == Status.SUCCEEDED
    row = WorkItem.objects.get(pk=child.pk)
    assert (row.status, row.waiting) == (Status.PENDING, False), "the child is still waiting"


def test_deleting_a_succeeded_parent_does_not_cancel_its_waiting_child() -> None:
    """Contract question. A child waits for p1 (succeeded) and p2 (pending); an operator
    deletes p1's row (the admin's delete, ``QuerySet.delete``), then p2 succeeds.

    ``Dependency`` has no foreign key and ``delete`` leaves p1's link, so
    ``completion._resolve`` finds a parent that "no longer exists" and
    cancels the child, although both its parents succeeded. ``prune`` deletes
    the links of the rows it deletes, so the same row pruned instead of
    deleted lets the child run: the two operator paths disagree. SPEC: the
    item runs once every listed item has succeeded, and is cancelled only
    if one "fails or is cancelled". Fix: a parent that succeeded is no
    condition any more (batches/models.py ``Dependency`` says so for parents
    that succeeded before the enqueue): delete a parent's links when it
    succeeds, in the ending's transaction (``_follow`` has them in hand; the admin would then
    show parents from another record), which also closes the prune window
    of ``test_pruning_a_succeeded_parent_never_cancels_its_waiting_child``.
    """
    p1 = Record.enqueue({"key": "p1"})
    p2 = Record.enqueue({"key": "p2"})
    child = Record.enqueue({"key": "child"}, after=[p1, p2])
    (a,) = claim(limit=1, handlers=["record"])
    assert a.pk == p1.pk
    succeed(a)
    WorkItem.objects.filter(pk=p1.pk).delete()
    (b,) = claim(limit=1, handlers=["record"])
    assert b.pk == p2.pk
    succeed(b)
    row = WorkItem.objects.get(pk=child.pk)
    assert (row.status, row.waiting) == (Status.PENDING, False), (
        f"the child ended {row.status}: {row.last_error}"
    )


@pytest.mark.server_db
def test_an_operator_cancel_racing_a_child_enqueue_cancels_the_child() -> None:
    """An operator cancels pending item x while a child is enqueued ``after=[x]``.

    The enqueue locks x, marks it ``has_dependents`` and writes the waiting
    child; the cancel (models.py ``cancel_pending``) reads which of its rows
    have dependents first, then waits for x's lock in its UPDATE and cancels
    x once the enqueue committed. Its list, read before, does not name x:
    nothing settles the child, which stays ``waiting`` (run_after in year
    9999) until a stale-recovery pass sweeps. completion.py's docstring
    names this race as the sweep's; it need not be one: read the rows to
    settle after the UPDATE (PostgreSQL and SQLite: ``UPDATE ... RETURNING
    id, has_dependents, batch_id``; MySQL: re-read the cancelled ids after
    the UPDATE, which at READ COMMITTED sees the enqueue's commit). SPEC: a
    cancelled parent cancels its dependents.
    """
    x = Record.enqueue({"key": "x"})
    enqueuer = Held(lambda: Record.enqueue({"key": "child"}, after=[x]))
    operator = Racer(lambda: WorkItem.objects.filter(pk=x.pk).cancel())
    wait_for_lock_waiters(1, operator)
    child = enqueuer.release()
    assert operator.outcome() == 1
    row = WorkItem.objects.get(pk=child.pk)
    assert row.status == Status.CANCELLED, f"the child is {row.status}, waiting={row.waiting}"


def test_a_rolled_back_completion_is_not_counted_or_logged_as_completed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An empty batch opened in a transaction that then rolls back (SPEC: "there is no
    batch, no item and no callback").

    The seal completes the empty batch, and ``completion._complete`` counts
    ``dbworker_batches_completed_total`` and logs "Batch #n complete ...
    enqueued batch_done as work item #m" inside the transaction; the
    rollback takes the batch and the callback away, the count and the line
    stay. The same for any ending whose transaction rolls back after the
    completion step (a deadlock retried by the success writer, an operator's
    cancel in a transaction that fails): the metric counts one batch twice,
    or a batch that never completed. Fix: count and log in
    ``transaction.on_commit(..., using=using)``.
    """
    from prometheus_client import REGISTRY

    def completed() -> float:
        labels = {"worker": "batch_done"}
        return REGISTRY.get_sample_value("dbworker_batches_completed_total", labels) or 0.0

    before = completed()

    def rolled_back() -> None:
        with transaction.atomic():
            with batch(on_complete=BatchDone):
                pass
            raise RuntimeError("the caller's transaction rolls back")

    caplog.set_level("INFO", logger="django_dbworker")
    with pytest.raises(RuntimeError, match="rolls back"):
        rolled_back()
    assert not WorkItem.objects.exists()
    lines = [r.getMessage() for r in caplog.records if "complete" in r.getMessage()]
    assert (completed() - before, lines) == (0, []), "a batch that never existed was completed"


def test_a_callback_completed_where_its_handler_is_not_registered_keeps_its_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The batch's callback handler has its own queue (``Echo``: ``echoes``). The last item
    ends in a process where that handler is not registered (a worker deployment with
    fewer installed apps, a web process whose admin cancels the last item after a
    deploy renamed the module).

    completion.py ``_complete`` then writes the callback to queue
    ``default`` with the default ``MAX_ATTEMPTS``: the workers that serve
    ``echoes`` never claim it. The queue was known when the batch was
    opened (``batch()`` refuses an unregistered handler). SPEC: the
    ``on_complete`` handler is enqueued exactly once; enqueue puts an item on
    its handler's queue. Fix: store the callback's queue (and max_attempts)
    on the ``Batch`` row at ``batch()`` (a migration: ask the lead), or
    resolve them only where the handler is known and keep the row's values
    otherwise.
    """
    from django_dbworker.registry import registry
    from tests.testapp.workers import Echo

    with batch(on_complete=Echo, payload={"x": 1}) as b:
        item = Noop.enqueue({})
    # This process forgets the handler (monkeypatch restores it after the test).
    monkeypatch.setattr(registry, "_handlers", {k: v for k, v in registry.items() if k != "echo"})
    WorkItem.objects.filter(pk=item.pk).cancel()
    (callback,) = WorkItem.objects.filter(handler="echo", payload__batch=b.id)
    assert (callback.queue, callback.max_attempts) == (Echo.queue, Echo.get_max_attempts())


@pytest.mark.server_db
@pytest.mark.xfail(
    strict=True,
    reason="documented cost (docs/topics/batches.md, What it costs): an after= enqueue "
    "locks its parents until its transaction ends",
)
def test_an_open_transaction_that_enqueued_a_child_does_not_stall_the_success_writer() -> None:
    """Design risk, proven. A web request enqueues ``after=[p]`` (p is running) inside its
    ``transaction.atomic()`` and then does slow work before committing; meanwhile the
    worker's success writer records p and an unrelated item q in one batch.

    dependencies.py ``lock_parents`` takes p's row lock (``FOR UPDATE``) in
    the caller's transaction and holds it until that transaction ends; the
    success writer's UPDATE of p waits for it, and with it the whole write
    of its batch (q's success too, and on MySQL the row locks that block
    those rows' heartbeats): a user's transaction length leaks into every
    worker whose writer touches p. Issue 22 asks that bookkeeping "must not
    become a hot row that serialises the success writer". Suggested fix:
    mark ``has_dependents`` in a short transaction of its own (committed
    before the child's insert), and settle the child once more on commit
    (``transaction.on_commit``), leaving the crash window to the sweep;
    or document the lock.
    """
    parent = Record.enqueue({"key": "p"})
    other = Record.enqueue({"key": "q"})
    running = sorted(claim(limit=2, handlers=["record"]), key=lambda i: i.pk)
    enqueuer = Held(lambda: Record.enqueue({"key": "c"}, after=[parent]))
    try:
        writer = Racer(
            lambda: transitions.succeed(
                [(i.pk, i.claim_token, None) for i in running],
                using="default",
                linked=transitions.linked_rows(running),
            )
        )
        wait_until(
            lambda: not writer.is_alive() or lock_waiters() >= 1,
            timeout=30,
            interval=0.25,
            what="the success write to end or wait",
        )
        recorded = WorkItem.objects.filter(pk=other.pk, status=Status.SUCCEEDED).exists()
    finally:
        enqueuer.release()
    writer.outcome()
    assert recorded, "q's success waited for a user's transaction that enqueued after p"


def test_after_stops_reading_at_the_limit_of_parents() -> None:
    """``after=`` given a long iterable of distinct ids (a query's ids by mistake).

    dependencies.py ``parent_ids`` deduplicates with ``pk not in ids`` on a
    list and checks ``MAX_PARENTS`` only after the loop: it reads the whole
    iterable and does quadratic work (100,000 ids: about 5 * 10**9
    comparisons, minutes of a web process's CPU) before raising the
    ``EnqueueError`` that says at most 1,000 are allowed. Expected: it stops
    at the 1,001st distinct id. Here a counting generator shows how far it
    reads. Fix: a ``set`` beside the list, and the check inside the loop.
    """
    from django_dbworker.batches.dependencies import MAX_PARENTS

    drawn = 0

    def ids() -> Iterator[int]:
        nonlocal drawn
        for pk in range(1, 5 * MAX_PARENTS + 1):
            drawn += 1
            yield pk

    with pytest.raises(EnqueueError, match="at most"):
        Record.enqueue({}, after=ids())
    assert drawn <= MAX_PARENTS + 1, f"read {drawn} ids to refuse more than {MAX_PARENTS}"
