"""Races on batches and ``after=`` dependencies, each interleaving forced on purpose.

SPEC "Batches and dependencies": the callback is enqueued exactly once, with
the right counts, by the transaction of the last ending, also when endings
(a worker's success, an operator's cancel, stale recovery) commit together;
a dependent is released exactly once, never stuck, never run before its
parents succeeded; an operator's verb and a worker's ending never deadlock;
the endings' reads after a lock see what the previous holder committed at
any isolation level the project configures (docs/topics/batches.md).

One ending's transaction is held open after its write (``interleave.Held``),
the other runs into the lock it holds (``interleave.Racer``), and only when
the database says it waits is the first committed. Where no lock can hold
one statement back, ``connection.execute_wrapper`` pauses a step just before
(or after) the statement it must precede. Every wait is bounded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction
from django.db.models.functions import Now

from django_dbworker import batch, transitions
from django_dbworker.batches import completion
from django_dbworker.batches.models import Batch, Dependency
from django_dbworker.db import operations
from django_dbworker.models import Status, WorkItem
from django_dbworker.retention import prune
from tests.conftest import lock_waiters, wait_until
from tests.factories import age_heartbeat, claim
from tests.integration.interleave import TIMEOUT, Held, Racer, wait_for_lock_waiters
from tests.testapp.workers import BatchDone, Noop, Record

pytestmark = pytest.mark.django_db(transaction=True)
server_db = pytest.mark.server_db

#: The session a project at ``OPTIONS["isolation_level"]``: READ COMMITTED is the
#: default; REPEATABLE READ takes a transaction's snapshot at its first statement.
ISOLATION = [
    pytest.param(None, id="read_committed"),
    pytest.param("repeatable_read", id="repeatable_read", marks=pytest.mark.postgres_only),
]


def callbacks(batch_id: int) -> list[WorkItem]:
    return list(WorkItem.objects.filter(handler="batch_done", payload__batch=batch_id))


def counts(batch_id: int) -> dict[str, Any]:
    (callback,) = callbacks(batch_id)
    return {k: callback.payload[k] for k in ("succeeded", "failed", "cancelled")}


def claimed_batch(n: int, handler: str = "noop") -> tuple[int, list[WorkItem]]:
    """A sealed batch of ``n`` items, all claimed (as a worker holds them)."""
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue_many([{}] * n)
    items = sorted(claim(limit=n, handlers=[handler]), key=lambda i: i.pk)
    assert len(items) == n
    return b.id, items


def succeed(item: WorkItem) -> set[Any]:
    """The success writer's write of one attempt."""
    assert item.claim_token is not None
    return transitions.succeed(
        [(item.pk, item.claim_token, None)],
        using="default",
        linked=transitions.linked_rows([item]),
    )


def _repeatable_read() -> None:
    """The session of a project with ``OPTIONS["isolation_level"]`` REPEATABLE READ."""
    connection.ensure_connection()
    if connection.vendor == "postgresql":
        import psycopg

        connection.connection.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    else:
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        connection.isolation_level = "repeatable read"  # what Django records at connect


SESSIONS: dict[str | None, Callable[[], None] | None] = {
    None: None,
    "repeatable_read": _repeatable_read,
}


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


def _paused_before(marker: str, paused: threading.Event, go: threading.Event) -> Any:
    """An ``execute_wrapper`` for this thread's connection that waits for ``go`` before the
    first statement containing ``marker`` (after setting ``paused``)."""

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if marker in sql and not paused.is_set():
            paused.set()
            assert go.wait(TIMEOUT)
        return execute(sql, params, many, context)

    return connection.execute_wrapper(wrapper)


def _signal_before(marker: str, reached: threading.Event) -> Any:
    """An ``execute_wrapper`` for this thread's connection that sets ``reached`` just
    before the first statement containing ``marker`` (and lets it run)."""

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if marker in sql:
            reached.set()
        return execute(sql, params, many, context)

    return connection.execute_wrapper(wrapper)


def _signal_after(marker: str, reached: threading.Event) -> Any:
    """An ``execute_wrapper`` that sets ``reached`` once a statement containing ``marker``
    has run (its snapshot taken, its locks held)."""

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        result = execute(sql, params, many, context)
        if marker in sql:
            reached.set()
        return result

    return connection.execute_wrapper(wrapper)


def _paused_after_batch_check(paused: threading.Event, go: threading.Event) -> Any:
    """An ``execute_wrapper`` that holds this thread's ending after the statement that
    follows its lock of a batch row (the check for unfinished items), before its commit."""
    locked: list[bool] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        result = execute(sql, params, many, context)
        if locked and not paused.is_set():
            paused.set()
            assert go.wait(TIMEOUT)
        if "django_dbworker_batch" in sql and "FOR UPDATE" in sql:
            locked.append(True)
        return result

    return connection.execute_wrapper(wrapper)


def _before_first_write(run: Callable[[], None]) -> Any:
    """An ``execute_wrapper`` for this thread's connection that calls ``run`` once, just
    before the first statement that is not a SELECT (a write, or SQLite's BEGIN)."""
    done: list[bool] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if not done and not sql.lstrip().upper().startswith("SELECT"):
            done.append(True)
            run()
        return execute(sql, params, many, context)

    return connection.execute_wrapper(wrapper)


def _in_other_thread(fn: Callable[[], Any]) -> Callable[[], None]:
    """``fn`` run to its end (its own connection, its own commits) in another thread."""

    def run() -> None:
        Racer(fn).outcome()

    return run


def _session_id() -> int:
    """This thread's connection's server-side id (PostgreSQL's backend pid, MariaDB's
    connection id)."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_backend_pid()")
        else:
            cursor.execute("SELECT CONNECTION_ID()")
        return int(cursor.fetchone()[0])


def _wait_until_blocked(session: list[int], step: Racer) -> None:
    """Until the connection ``session[0]`` waits for a row lock (bounded). By its id:
    InnoDB's ``innodb_trx`` may answer from a cache up to 0.1 s old, which can hold
    another test's waiter, never this new connection's."""

    def blocked() -> bool:
        if not step.is_alive():
            return True
        if not session:
            return False
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = %s "
                    "AND wait_event_type = 'Lock'",
                    [session[0]],
                )
            else:
                cursor.execute(
                    "SELECT count(*) FROM information_schema.innodb_trx "
                    "WHERE trx_mysql_thread_id = %s AND trx_state = 'LOCK WAIT'",
                    [session[0]],
                )
            return bool(cursor.fetchone()[0])

    wait_until(blocked, timeout=TIMEOUT, interval=0.25, what="the step waiting for a lock")
    if not step.is_alive():
        step.outcome()
        raise AssertionError("the step ended without waiting for the lock")


# -- the last ending of a batch enqueues its callback, once --


@server_db
@pytest.mark.parametrize("isolation", ISOLATION)
def test_two_finishers_of_the_last_two_items_fire_one_callback(isolation: str | None) -> None:
    """Finisher A writes its success and holds the batch row's lock (seeing B's item
    claimed); B writes its success, waits for the batch row, and once A commits its read
    must see A's item succeeded, also at REPEATABLE READ, whose snapshot B's first
    statement took before A's commit (``ending_transaction`` sets READ COMMITTED)."""
    batch_id, (a, b) = claimed_batch(2)
    first = Held(lambda: succeed(a))
    second = Racer(lambda: succeed(b), session=SESSIONS[isolation])
    wait_for_lock_waiters(1, second)
    assert callbacks(batch_id) == []
    first.release()
    second.outcome()
    assert counts(batch_id) == {"succeeded": 2, "failed": 0, "cancelled": 0}
    assert Batch.objects.get(pk=batch_id).completed_at is not None


@server_db
def test_two_finishers_fire_one_callback_when_the_first_is_held_before_the_batch_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both items claimed; finisher A writes its success and is held right before it
    locks the batch row; finisher B writes, locks, reads (sees A's item claimed) and
    commits; then A goes on: its read after the lock sees B's commit. One callback."""
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue_many([{}, {}])
    first, second = claim(limit=2, handlers=["noop"])
    reached, release = threading.Event(), threading.Event()
    real = completion.complete_batches
    calls: list[int] = []

    def held(batch_ids: Any, using: str, *, quick: bool = False) -> list[int]:
        calls.append(1)
        if len(calls) == 1:
            reached.set()
            assert release.wait(20)
        return real(batch_ids, using, quick=quick)

    monkeypatch.setattr(completion, "complete_batches", held)
    a = Racer(lambda: succeed(first))
    assert reached.wait(20)
    succeed(second)
    assert callbacks(b.id) == []  # B saw A's item still claimed
    release.set()
    a.outcome()
    assert len(callbacks(b.id)) == 1


@pytest.mark.postgres_only
@pytest.mark.parametrize("isolation", ["READ COMMITTED", "REPEATABLE READ"])
def test_the_last_of_two_concurrent_finishers_completes_the_batch_at_any_isolation_level(
    isolation: str,
) -> None:
    """Both finishers of a batch's last two items wait for the batch row together (a third
    transaction holds it); whichever locks it second must see the other's success.

    At REPEATABLE READ an ending's snapshot would be taken by its success UPDATE, before the
    lock, so each would see the other's item claimed and neither complete the batch: the
    ending's transaction runs at READ COMMITTED whatever the project configures.
    """
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue({})
        Noop.enqueue({})
    claimed = claim(handlers=["noop"])
    assert len(claimed) == 2
    hold, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def finish(item: WorkItem) -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute(
                    f"SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL {isolation}"
                )
            assert item.claim_token is not None
            transitions.succeed([(item.pk, item.claim_token, None)], linked={item.pk: b.id})
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)
        finally:
            connections.close_all()

    def holder() -> None:
        try:
            with transaction.atomic():
                list(Batch.objects.select_for_update().filter(pk=b.id))
                hold.set()
                release.wait(timeout=30)
        finally:
            connections.close_all()

    lock = threading.Thread(target=holder)
    lock.start()
    hold.wait(timeout=20)
    finishers = [threading.Thread(target=finish, args=(item,)) for item in claimed]
    for thread in finishers:
        thread.start()
    # Polled from this thread's connection: a transaction sees pg_stat_activity
    # as it was when it first read it.
    wait_until(lambda: lock_waiters() >= 2, timeout=20, what="both finishers at the lock")
    release.set()
    lock.join(timeout=30)
    for thread in finishers:
        thread.join(timeout=30)
    assert not errors, errors
    assert set(WorkItem.objects.filter(batch_id=b.id).values_list("status", flat=True)) == {
        "succeeded"
    }
    assert Batch.objects.get(pk=b.id).completed_at is not None
    assert WorkItem.objects.filter(handler=BatchDone.name).count() == 1


@server_db
def test_a_cancel_of_the_pending_item_a_finisher_holds_waits_and_completes_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finisher F ends item a and share-locks pending item c (so it skips the batch
    lock); an operator cancels c meanwhile. The cancel must wait for F's commit, so
    that its own check sees a succeeded: one callback. Were c only read, not locked,
    the cancel would check first, see a claimed, and neither would enqueue it."""
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue({})
        pending = Noop.enqueue({})
    (running,) = claim(limit=1, handlers=["noop"])
    assert running.pk != pending.pk
    probed, release = threading.Event(), threading.Event()
    real = completion.holds_a_pending_item

    def held(batch_id: int, using: str) -> bool:
        found = real(batch_id, using)
        probed.set()
        assert release.wait(20)
        return found

    monkeypatch.setattr(completion, "holds_a_pending_item", held)
    finisher = Racer(lambda: succeed(running))
    assert probed.wait(20)
    monkeypatch.setattr(completion, "holds_a_pending_item", real)
    canceller = Racer(lambda: WorkItem.objects.filter(pk=pending.pk).cancel_pending())
    wait_for_lock_waiters(1, canceller)
    release.set()
    finisher.outcome()
    canceller.outcome()
    assert WorkItem.objects.get(pk=pending.pk).status == Status.CANCELLED
    assert len(callbacks(b.id)) == 1
    assert Batch.objects.get(pk=b.id).completed_at is not None


@server_db
@pytest.mark.parametrize("isolation", [None, "repeatable_read"], ids=["read_committed", "rr"])
def test_operator_cancel_of_the_last_item_while_a_worker_finishes_another(
    isolation: str | None,
) -> None:
    """The worker's ending holds the batch row's lock and sees the pending item; the
    operator's cancel waits for the batch row and must then read the worker's item as
    succeeded, also at REPEATABLE READ (its first read took the snapshot)."""
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue({})
        last = Noop.enqueue({})
    (a,) = claim(limit=1, handlers=["noop"])
    finisher = Held(lambda: succeed(a))
    operator = Racer(
        lambda: WorkItem.objects.filter(pk=last.pk).cancel(), session=SESSIONS[isolation]
    )
    wait_for_lock_waiters(1, operator)
    finisher.release()
    assert operator.outcome() == 1
    assert counts(b.id) == {"succeeded": 1, "failed": 0, "cancelled": 1}


@server_db
def test_a_worker_finishing_while_an_operator_cancel_of_the_last_item_is_uncommitted() -> None:
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue({})
        last = Noop.enqueue({})
    (a,) = claim(limit=1, handlers=["noop"])
    operator = Held(lambda: WorkItem.objects.filter(pk=last.pk).cancel())
    finisher = Racer(lambda: succeed(a))
    wait_for_lock_waiters(1, finisher)
    operator.release()
    finisher.outcome()
    assert counts(b.id) == {"succeeded": 1, "failed": 0, "cancelled": 1}


@server_db
def test_stale_recovery_failing_the_last_item_while_another_finishes() -> None:
    batch_id, (a, b) = claimed_batch(2)
    WorkItem.objects.filter(pk=b.pk).update(max_attempts=1)
    age_heartbeat(b, 3600)
    finisher = Held(lambda: succeed(a))
    recovery = Racer(lambda: transitions.recover_stale(stale_after=60))
    wait_for_lock_waiters(1, recovery)
    finisher.release()
    assert recovery.outcome().failed == 1
    assert counts(batch_id) == {"succeeded": 1, "failed": 1, "cancelled": 0}


@pytest.mark.server_db
def test_a_recovery_pass_at_repeatable_read_failing_the_last_item_completes_the_batch() -> None:
    """A project at REPEATABLE READ: a stale-recovery pass fails the batch's last item x while
    another worker's success of item a, held after its check under the batch row's lock, is
    being committed. The pass runs in ``ending_transaction`` (READ COMMITTED), so its read
    after the batch row's lock sees a succeeded: one callback once the pass commits, not at
    some worker's next sweep.
    """
    batch_id, (a, x) = claimed_batch(2)
    WorkItem.objects.filter(pk=x.pk).update(max_attempts=1)  # its last attempt ran
    age_heartbeat(x, 600)
    paused, go = threading.Event(), threading.Event()

    def finisher_success() -> set[Any]:
        # Its own ending transaction (not nested in a test's atomic block, whose
        # commit would settle again): held after its check under the batch row's lock.
        with _paused_after_batch_check(paused, go):
            return succeed(a)

    finisher = Racer(finisher_success)
    assert paused.wait(TIMEOUT)

    def recovery_pass() -> int:
        # As worker/recovery.py runs it: ending_transaction, READ COMMITTED.
        with operations("default").ending_transaction():
            return transitions.recover_stale(stale_after=60, using="default", log=False).failed

    read = threading.Event()

    def recovery_pass_signalled() -> int:
        with _signal_after("django_dbworker_workitem", read):  # the pass's snapshot
            return recovery_pass()

    recovery = Racer(recovery_pass_signalled, session=_repeatable_read)
    assert read.wait(TIMEOUT)
    go.set()
    finisher.outcome()
    assert recovery.outcome() == 1
    statuses = sorted(WorkItem.objects.filter(batch_id=batch_id).values_list("status", flat=True))
    assert statuses == [Status.FAILED, Status.SUCCEEDED]
    assert len(callbacks(batch_id)) == 1, "every item ended and no callback was enqueued"


@pytest.mark.mysql_only
def test_an_atomic_handler_finishing_the_last_item_at_repeatable_read_fires_the_callback() -> None:
    """MariaDB at REPEATABLE READ: the batch's last item is an ``atomic = True`` handler's, whose
    success write is nested in the handler's transaction (its snapshot taken by the
    handler's first read). The other item's success commits meanwhile; the batch check must
    not read it as claimed: one callback.
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


@pytest.mark.postgres_only
def test_an_atomic_handler_at_repeatable_read_succeeds_while_its_batch_runs() -> None:
    """PostgreSQL at REPEATABLE READ: an ``atomic = True`` handler runs item x while another
    worker claims the batch's other item p. The nested success write must not try the
    quick path's share lock on p (updated after the handler's snapshot: "could not
    serialize access"): x succeeds, the batch stays open.
    """
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue_many([{}, {}])
    (x,) = claim(limit=1, handlers=["noop"])
    ready, go = threading.Event(), threading.Event()

    def atomic_handler_run() -> set[Any]:
        with transaction.atomic():
            WorkItem.objects.filter(pk=x.pk).exists()  # the handler reads something
            ready.set()
            assert go.wait(TIMEOUT)
            return succeed(x)

    handler = Racer(atomic_handler_run, session=_repeatable_read)
    assert ready.wait(TIMEOUT)
    (p,) = claim(limit=1, handlers=["noop"])  # another worker, committed
    assert p.pk != x.pk
    go.set()
    assert handler.outcome() == {(x.pk, x.claim_token)}
    assert WorkItem.objects.get(pk=x.pk).status == Status.SUCCEEDED
    assert not callbacks(b.id)


@pytest.mark.server_db
def test_a_cancel_in_a_request_transaction_at_repeatable_read_completes_the_batch() -> None:
    """REPEATABLE READ with ``ATOMIC_REQUESTS``: the admin cancels the last pending item p in a
    request that read first; meanwhile a worker committed the success of the other item a
    (its quick path skipped the batch row). The cancel joins the request's transaction,
    whose snapshot sees a claimed, so the batch is settled again after the request
    commits: one callback then.
    """
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue_many([{}, {}])
    (a,) = claim(limit=1, handlers=["noop"])
    (p,) = WorkItem.objects.filter(batch_id=b.id).exclude(pk=a.pk)
    ready, go = threading.Event(), threading.Event()

    def admin_request() -> int:
        with transaction.atomic():  # ATOMIC_REQUESTS
            WorkItem.objects.filter(batch_id=b.id).count()  # the changelist's first read
            ready.set()
            assert go.wait(TIMEOUT)
            return WorkItem.objects.filter(pk=p.pk).cancel()

    request = Racer(admin_request, session=_repeatable_read)
    assert ready.wait(TIMEOUT)
    assert succeed(a) == {(a.pk, a.claim_token)}  # the worker, committed
    go.set()
    assert request.outcome() == 1
    assert len(callbacks(b.id)) == 1, "every item ended and no callback was enqueued"


@pytest.mark.postgres_only
def test_a_callback_insert_that_fails_rolls_back_the_last_items_success() -> None:
    """A trigger refuses the callback's row: the last item's success rolls back with it."""
    from django.db import DatabaseError, connection

    batch_id, (a,) = claimed_batch(1)
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION refuse_callback() RETURNS trigger AS $$ BEGIN "
            "IF NEW.handler = 'batch_done' THEN RAISE EXCEPTION 'no callbacks today'; END IF; "
            "RETURN NEW; END $$ LANGUAGE plpgsql"
        )
        cursor.execute(
            "CREATE TRIGGER refuse_callback BEFORE INSERT ON django_dbworker_workitem "
            "FOR EACH ROW EXECUTE FUNCTION refuse_callback()"
        )
    try:
        with pytest.raises(DatabaseError, match="no callbacks today"):
            succeed(a)
        row = WorkItem.objects.get(pk=a.pk)
        assert (row.status, row.claim_token) == (Status.CLAIMED, a.claim_token)
        assert Batch.objects.get(pk=batch_id).completed_at is None
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER refuse_callback ON django_dbworker_workitem")
            cursor.execute("DROP FUNCTION refuse_callback()")
    assert succeed(a) == {(a.pk, a.claim_token)}
    assert counts(batch_id) == {"succeeded": 1, "failed": 0, "cancelled": 0}


# -- a dependent is released once its parents succeeded, cancelled if one did not --


@server_db
@pytest.mark.parametrize("isolation", ISOLATION)
def test_a_fan_in_child_is_released_once_when_its_parents_succeed_together(
    isolation: str | None,
) -> None:
    """The second finisher locks the child after the first committed: its read of the
    parents must see both succeeded, also at REPEATABLE READ."""
    p1 = Record.enqueue({"key": "p1"})
    p2 = Record.enqueue({"key": "p2"})
    child = Record.enqueue({"key": "child"}, after=[p1, p2])
    a, b = sorted(claim(limit=2, handlers=["record"]), key=lambda i: i.pk)
    assert (a.pk, b.pk) == (p1.pk, p2.pk) and a.has_dependents and b.has_dependents
    first = Held(lambda: succeed(a))
    second = Racer(lambda: succeed(b), session=SESSIONS[isolation])
    wait_for_lock_waiters(1, second)
    first.release()
    second.outcome()
    row = WorkItem.objects.get(pk=child.pk)
    assert (row.status, row.waiting) == (Status.PENDING, False)
    assert [i.pk for i in claim(handlers=["record"])] == [child.pk]


@server_db
def test_a_child_enqueued_while_its_parents_success_is_uncommitted_is_due_at_once() -> None:
    parent = Record.enqueue({"key": "p"})
    (running,) = claim(handlers=["record"])
    finisher = Held(lambda: succeed(running))
    enqueuer = Racer(lambda: Record.enqueue({"key": "c"}, after=[parent]))
    wait_for_lock_waiters(1, enqueuer)
    finisher.release()
    child = WorkItem.objects.get(pk=enqueuer.outcome().pk)
    assert (child.status, child.waiting) == (Status.PENDING, False)


@server_db
def test_a_parents_success_racing_an_uncommitted_child_enqueue_releases_the_child() -> None:
    parent = Record.enqueue({"key": "p"})
    (running,) = claim(handlers=["record"])
    assert not running.has_dependents  # the claim did not know: the "late" path
    enqueuer = Held(lambda: Record.enqueue({"key": "c"}, after=[parent]))
    finisher = Racer(lambda: succeed(running))
    wait_for_lock_waiters(1, finisher)
    child = enqueuer.release()
    assert finisher.outcome() == {(running.pk, running.claim_token)}
    row = WorkItem.objects.get(pk=child.pk)
    assert (row.status, row.waiting) == (Status.PENDING, False)


@server_db
def test_a_parents_failure_racing_an_uncommitted_child_enqueue_cancels_the_child() -> None:
    parent = Record.enqueue({"key": "p"})
    (running,) = claim(handlers=["record"])
    enqueuer = Held(lambda: Record.enqueue({"key": "c"}, after=[parent]))
    finisher = Racer(lambda: transitions.fail(running, error="boom"))
    wait_for_lock_waiters(1, finisher)
    child = enqueuer.release()
    assert finisher.outcome() is True
    row = WorkItem.objects.get(pk=child.pk)
    assert row.status == Status.CANCELLED and f"#{parent.pk}" in row.last_error


@pytest.mark.server_db
def test_an_operator_cancel_racing_a_child_enqueue_cancels_the_child() -> None:
    """An operator cancels pending item x while a child is enqueued ``after=[x]`` (the enqueue
    holds x's lock). The cancel reads which of its rows have dependents after its UPDATE,
    so the child is cancelled, not left waiting for a sweep.
    """
    x = Record.enqueue({"key": "x"})
    enqueuer = Held(lambda: Record.enqueue({"key": "child"}, after=[x]))
    operator = Racer(lambda: WorkItem.objects.filter(pk=x.pk).cancel())
    wait_for_lock_waiters(1, operator)
    child = enqueuer.release()
    assert operator.outcome() == 1
    row = WorkItem.objects.get(pk=child.pk)
    assert row.status == Status.CANCELLED, f"the child is {row.status}, waiting={row.waiting}"


@pytest.mark.server_db
def test_a_lost_connection_after_a_parents_success_does_not_leave_its_child_waiting() -> None:
    """A child is enqueued ``after=[p]`` while p runs; the success writer records p and its
    connection is killed while it waits for the child's lock. The retried write finds p
    already succeeded and still settles the child: it is due, not waiting for a sweep.
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


@pytest.mark.server_db
@pytest.mark.xfail(
    strict=True,
    reason="documented cost (docs/topics/batches.md, What it costs): an after= enqueue "
    "locks its parents until its transaction ends",
)
def test_an_open_transaction_that_enqueued_a_child_does_not_stall_the_success_writer() -> None:
    """A request enqueues ``after=[p]`` (p running) and holds its transaction open; the
    success writer records p and an unrelated q in one write. ``lock_parents`` holds p's
    row lock until the request commits, so q's success waits too (documented cost).
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


# -- endings and operator verbs lock items before batches, parents before children --


@pytest.mark.server_db
def test_cancelling_a_batch_while_a_worker_finishes_one_of_its_items_does_not_deadlock() -> None:
    """An operator cancels a whole batch while a worker writes the success of one of its
    claimed items s. ``cancel()`` locks its pending and claimed rows in id order before it
    touches the batch row, as every ending does (items first, batch last): it waits for s,
    and both commit, one callback.
    """
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue_many([{}, {}])
    (s,) = claim(limit=1, handlers=["noop"])
    probe = "SKIP LOCKED"  # db/batch_probe.py's statement: after the success write
    paused, go = threading.Event(), threading.Event()

    def worker_success() -> set[Any]:
        with _paused_before(probe, paused, go):
            return succeed(s)

    worker = Racer(worker_success)
    assert paused.wait(TIMEOUT)
    reached = threading.Event()

    def operator_cancel() -> int:
        # Signalled as the cancel locks its rows (in id order: s, whose success the
        # worker holds uncommitted, then p), before it cancels or asks any; the worker
        # then goes on, and whichever order the two commit in, both must.
        with _signal_before("FOR UPDATE", reached):
            return WorkItem.objects.filter(batch_id=b.id).cancel()

    operator = Racer(operator_cancel)
    assert reached.wait(TIMEOUT)
    go.set()
    errors = []
    for name, step in (("worker", worker), ("operator", operator)):
        try:
            step.outcome()
        except Exception as exc:  # both must commit
            errors.append((name, exc))
    assert not errors, errors
    statuses = dict(WorkItem.objects.filter(batch_id=b.id).values_list("pk", "status"))
    assert statuses[s.pk] == Status.SUCCEEDED
    assert sorted(statuses.values()) == [Status.CANCELLED, Status.SUCCEEDED]
    assert len(callbacks(b.id)) == 1


@pytest.mark.server_db
def test_retrying_a_child_while_its_parent_succeeds_does_not_deadlock() -> None:
    """An operator retries the cancelled child c of a running parent a as a's success is
    written. Both lock parents before children (InnoDB's locking read waits for a row
    another transaction wrote, whatever its WHERE): both commit, c due.
    """
    a = Record.enqueue({"key": "a"})
    c = Record.enqueue({"key": "c"}, after=[a])
    (running,) = claim(limit=1, handlers=["record"])
    assert running.pk == a.pk
    assert WorkItem.objects.get(pk=c.pk).cancel()
    paused, go = threading.Event(), threading.Event()

    def parent_success() -> set[Any]:
        with _paused_before("django_dbworker_dependency", paused, go):
            return succeed(running)

    ending = Racer(parent_success)
    assert paused.wait(TIMEOUT)
    reached = threading.Event()

    def operator_retry() -> int:
        # Signalled once c is updated: wait_again's lock of the parents comes next.
        with _signal_before("FOR UPDATE", reached):
            return WorkItem.objects.filter(pk=c.pk).retry()

    operator = Racer(operator_retry)
    assert reached.wait(TIMEOUT)
    go.set()
    errors = []
    for name, step in (("ending", ending), ("operator", operator)):
        try:
            step.outcome()
        except Exception as exc:  # both must commit
            errors.append((name, exc))
    assert not errors, errors
    assert WorkItem.objects.get(pk=a.pk).status == Status.SUCCEEDED
    row = WorkItem.objects.get(pk=c.pk)
    assert (row.status, row.waiting) == (Status.PENDING, False)


@pytest.mark.server_db
def test_cancelling_a_parent_and_a_waiting_child_while_another_parent_succeeds() -> None:
    """Parents a (running) and p (pending); x waits for both, w for a. The operator cancels p
    and w while a's success is written: the cancel holds w and waits for x, the ending holds
    x and waits for w. Documented (batches.md): the database may roll one of them back as a
    deadlock; the worker's write is retried (by the success writer, here by hand), the
    operator's action shows the error and changed nothing. Whichever way it goes, the end is
    the same: a succeeded, p, w and x cancelled.
    """
    from django_dbworker.db.errors import is_transient

    a = Record.enqueue({"key": "a"})
    p = Record.enqueue({"key": "p"})
    x = Record.enqueue({"key": "x"}, after=[a, p])
    w = Record.enqueue({"key": "w"}, after=[a])
    assert a.pk < p.pk < x.pk < w.pk
    (running,) = claim(limit=1, handlers=["record"])
    assert running.pk == a.pk
    paused, go = threading.Event(), threading.Event()

    def operator_cancel() -> int:
        with _paused_before("django_dbworker_dependency", paused, go):
            return WorkItem.objects.filter(pk__in=[p.pk, w.pk]).cancel_pending()

    operator = Racer(operator_cancel)
    assert paused.wait(TIMEOUT)  # p and w are updated, not committed
    session: list[int] = []

    def parent_success() -> set[Any]:
        session.append(_session_id())
        return succeed(running)

    ending = Racer(parent_success)
    _wait_until_blocked(session, ending)  # the ending holds x, waits for w
    go.set()
    errors: dict[str, Exception] = {}
    for name, step in (("ending", ending), ("operator", operator)):
        try:
            step.outcome()
        except Exception as exc:
            errors[name] = exc
    # At most one rolled back, and only as a deadlock (an error a retry may not meet).
    assert len(errors) <= 1, errors
    assert all(is_transient(exc) for exc in errors.values()), errors
    if "operator" in errors:  # it changed nothing: the operator sees the error, tries again
        assert WorkItem.objects.get(pk=p.pk).status == Status.PENDING
        assert WorkItem.objects.get(pk=w.pk).status == Status.PENDING
        WorkItem.objects.filter(pk__in=[p.pk, w.pk]).cancel_pending()
    if "ending" in errors:  # the success writer retries its write
        assert WorkItem.objects.get(pk=a.pk).status == Status.CLAIMED
        succeed(running)
    statuses = dict(WorkItem.objects.values_list("pk", "status"))
    assert statuses == {
        a.pk: Status.SUCCEEDED,
        p.pk: Status.CANCELLED,
        x.pk: Status.CANCELLED,
        w.pk: Status.CANCELLED,
    }


@pytest.mark.server_db
def test_a_recovery_pass_of_several_chunks_does_not_deadlock_with_a_zombies_success() -> None:
    """A stale-recovery pass over more stale rows than one chunk (``batch_size=1``) while a
    zombie worker writes the success of one of them, both items of one batch. The pass
    locks every chunk's rows before any batch row: both commit, x1 failed, x2 succeeded.
    """
    batch_id, (x1, x2) = claimed_batch(2)
    WorkItem.objects.filter(pk=x1.pk).update(max_attempts=1)  # its last attempt ran
    age_heartbeat(x1, 600)
    age_heartbeat(x2, 600)
    paused, go = threading.Event(), threading.Event()

    def zombie_success() -> set[Any]:
        with _paused_before("django_dbworker_batch", paused, go):
            return succeed(x2)

    zombie = Racer(zombie_success)
    assert paused.wait(TIMEOUT)  # x2 written, the batch row not locked yet

    def recovery_pass() -> Any:
        # As worker/recovery.py runs it: ending_transaction, READ COMMITTED.
        with operations("default").ending_transaction():
            return transitions.recover_stale(
                stale_after=60, using="default", log=False, batch_size=1
            )

    locked = threading.Event()

    def recovery_pass_signalled() -> Any:
        with _signal_after("django_dbworker_batch", locked):  # chunk 1 settled: batch locked
            return recovery_pass()

    recovery = Racer(recovery_pass_signalled)
    # The pass waits for x2 before it locks the batch row (items first, batches last).
    wait_until(
        lambda: locked.is_set() or lock_waiters() >= 1,
        timeout=TIMEOUT,
        interval=0.25,
        what="the recovery pass to lock the batch row or wait for x2",
    )
    go.set()
    errors = []
    for name, step in (("zombie", zombie), ("recovery", recovery)):
        try:
            step.outcome()
        except Exception as exc:  # both must commit
            errors.append((name, exc))
    assert not errors, errors
    statuses = dict(WorkItem.objects.filter(batch_id=batch_id).values_list("pk", "status"))
    assert statuses == {x1.pk: Status.FAILED, x2.pk: Status.SUCCEEDED}


# -- pruning deletes a row and its links together --


@pytest.mark.server_db
def test_pruning_a_succeeded_parent_never_cancels_its_waiting_child() -> None:
    """A child waits for p1 (succeeded, old enough to prune) and p2 (running); retention
    prunes p1 (its link row held locked, as a slow pruner would) while p2's success is
    written. Prune deletes the items and their links in one transaction, so the child
    runs: a pruned parent had succeeded.
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


def test_pruning_racing_a_retry_keeps_the_retried_childs_link_to_its_parent() -> None:
    """A chain a -> b (a failed, b cancelled); retention prunes failed and cancelled rows
    while an operator retries both. Prune deletes the links of the rows it deleted only:
    the retried b keeps its link and waits, and only a is claimed.
    """
    a = Record.enqueue({"key": "a"})
    b = Record.enqueue({"key": "b"}, after=[a])
    (running,) = claim(limit=1, handlers=["record"])
    assert running.pk == a.pk
    assert transitions.fail(running, error="boom")
    assert WorkItem.objects.get(pk=b.pk).status == Status.CANCELLED
    WorkItem.objects.filter(pk__in=[a.pk, b.pk]).update(finished_at=Now() - timedelta(days=30))

    def operator_retries() -> None:
        assert WorkItem.objects.filter(pk__in=[a.pk, b.pk]).retry() == 2

    with _before_first_write(_in_other_thread(operator_retries)):
        deleted = prune(older_than=timedelta(days=7), statuses=[Status.FAILED, Status.CANCELLED])
    assert deleted == 0, "the retried rows are pending: nothing of theirs is deleted"
    row = WorkItem.objects.get(pk=b.pk)
    assert (row.status, row.waiting) == (Status.PENDING, True)
    assert Dependency.objects.filter(child_id=b.pk, parent_id=a.pk).exists(), (
        "prune deleted the link of a row it did not delete"
    )
    completion.sweep("default")  # a worker's stale-recovery pass
    claimed = {item.pk for item in claim(handlers=["record"])}
    assert claimed == {a.pk}, f"b (#{b.pk}) was claimed while its parent a (#{a.pk}) is pending"
