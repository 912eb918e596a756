"""Second attack on batches and ``after=`` dependencies (issue 22): each test proves a bug.

Every test here FAILS against the fixes of the first attack round (branch
h-attack2 at bd9bd75) on the databases its docstring names (the others run
it as a regression test); its docstring says the scenario, what SPEC
"Batches and dependencies" and docs/topics/batches.md require, the cause and
a suggested fix. Real databases only; interleavings are forced with threads
that own their connections (``interleave.py``), or, where no lock can hold
one statement back, with Django's ``connection.execute_wrapper`` running
the other side to its commit just before the statement it must precede.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.db.models.functions import Now

from django_dbworker import batch, transitions
from django_dbworker.batches import completion
from django_dbworker.batches.models import Dependency
from django_dbworker.db import operations
from django_dbworker.models import Status, WorkItem
from django_dbworker.retention import prune
from tests.conftest import lock_waiters, wait_until
from tests.factories import age_heartbeat, claim
from tests.integration.interleave import TIMEOUT, Racer
from tests.integration.test_batches_races import callbacks, succeed
from tests.testapp.workers import BatchDone, Noop, Record

pytestmark = pytest.mark.django_db(transaction=True)


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


def _signal_after(marker: str, reached: threading.Event) -> Any:
    """An ``execute_wrapper`` that sets ``reached`` once a statement containing ``marker``
    has run (its snapshot taken, its locks held)."""

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        result = execute(sql, params, many, context)
        if marker in sql:
            reached.set()
        return result

    return connection.execute_wrapper(wrapper)


# -- pruning deletes the links of rows it did not delete --------------------------


def test_pruning_racing_a_retry_keeps_the_retried_childs_link_to_its_parent() -> None:
    """A chain a -> b: a failed, so b was cancelled without running. Retention prunes
    failed and cancelled rows while an operator retries both (the guide: "retry the
    parent and its children in one action").

    retention.py ``prune`` reads a batch of ids, then deletes the rows still
    finished (``status__in=allowed``: the retried a and b are pending now and
    stay) and, in the same transaction, the ``Dependency`` rows of *every id
    it read* (``Q(child_id__in=ids) | Q(parent_id__in=ids)``), including the
    rows it did not delete. The retried b is left ``waiting`` with no link:
    the next sweep (every worker's stale-recovery pass) finds a waiting row
    without an unfinished parent and releases it, and the next claim runs b
    while a has not run at all. (Were a to fail again, b would not be
    cancelled either: a's ending finds no link.) SPEC: b "is not claimed
    until every listed item has succeeded"; Dependency's docstring: "Pruning
    deletes the links of the rows it deletes". Expected: b's link stays, b
    keeps waiting, and only a is claimed. Fix: delete the links of the ids
    actually deleted: read them back after the DELETE (``ids`` minus those
    still present), or delete the links first with the same status
    condition (``Dependency.filter(Q(child__in=deletable) |
    Q(parent__in=deletable))`` where ``deletable`` is the item subquery of
    the DELETE), in the transaction, with the item rows locked first.
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


# -- PostgreSQL: the isolation level rides on psycopg's BEGIN -----------------------


@pytest.fixture
def manual_transaction() -> Iterator[None]:
    """Autocommit off, as ``AUTOCOMMIT: False`` in DATABASES leaves every connection
    (supported: tests/integration/test_enqueue_manual_transactions.py)."""
    transaction.set_autocommit(False)
    try:
        yield
    finally:
        transaction.rollback()
        connection.needs_rollback = False
        transaction.set_autocommit(True)


@pytest.mark.parametrize("read_first", [False, True])
def test_an_operator_cancel_in_a_manual_transaction_cancels_and_returns(
    manual_transaction: None, read_first: bool
) -> None:
    """PostgreSQL, Django's manual transaction mode (``AUTOCOMMIT: False``): a script
    cancels the last pending item of a batch, then commits.

    ``WorkItem.cancel`` runs in ``ending_transaction``; ``in_atomic_block``
    is False in manual mode although a transaction is (or is about to be)
    open, so postgresql.py ``_read_committed_transaction`` assigns
    ``raw.isolation_level``, which psycopg refuses inside a transaction:
    with a statement run before (``read_first``) the cancel raises
    ``ProgrammingError: can't change 'isolation_level' now: connection in
    transaction status INTRANS`` before doing anything; without one, the
    cancel's savepoint opens the transaction and the *restore* in the
    ``finally`` raises it, after the cancel and the batch's completion were
    written (the caller gets an exception for work that was done). Enqueue
    works in manual mode (test_enqueue_manual_transactions.py), and so did
    ``cancel`` before ``ending_transaction`` set the level. Expected: the
    cancel returns True and commits with the caller's ``commit()``, the
    callback with it. Fix: take the psycopg path only when the connection
    is in autocommit mode (``connection.get_autocommit()``) and idle; in a
    caller's (manual or atomic) transaction keep its level, as for
    ``in_atomic_block``.
    """
    with batch(on_complete=BatchDone) as b:
        last = Noop.enqueue({})
    transaction.commit()
    item = WorkItem.objects.get(pk=last.pk) if read_first else last
    assert item.cancel()
    transaction.commit()
    assert WorkItem.objects.get(pk=last.pk).status == Status.CANCELLED
    assert len(callbacks(b.id)) == 1


def test_an_operator_retry_in_a_manual_transaction_returns(manual_transaction: None) -> None:
    """PostgreSQL, manual transaction mode: ``QuerySet.retry`` of a failed parent and
    its cancelled child (the guide's "retry the parent and its children in one
    action"). As above: the retry runs in ``ending_transaction`` (``_Endings``
    port), whose restore of psycopg's ``isolation_level`` raises
    ``ProgrammingError`` inside the open transaction. Expected: 2 rows retried,
    the child waiting for its parent again. Same fix.
    """
    a = Record.enqueue({"key": "a"})
    b = Record.enqueue({"key": "b"}, after=[a])
    transaction.commit()
    (running,) = claim(limit=1, handlers=["record"])
    transaction.commit()
    assert transitions.fail(running, error="boom")
    transaction.commit()
    assert WorkItem.objects.filter(pk__in=[a.pk, b.pk]).retry() == 2
    transaction.commit()
    row = WorkItem.objects.get(pk=b.pk)
    assert (row.status, row.waiting) == (Status.PENDING, True)


# -- PostgreSQL REPEATABLE READ: the quick path's share lock ------------------------


def _repeatable_read() -> None:
    """The session a project with ``OPTIONS["isolation_level"] = REPEATABLE READ`` gets."""
    import psycopg

    connection.ensure_connection()
    connection.connection.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ


@pytest.mark.postgres_only
def test_an_atomic_handler_at_repeatable_read_succeeds_while_its_batch_runs() -> None:
    """PostgreSQL, a project at REPEATABLE READ (supported: the guide's "What it costs",
    "at a stricter level its batch and dependents are settled once more right after it
    commits"): an ``atomic = True`` handler runs item x of a batch; while it runs,
    another worker claims the batch's other item p.

    The handler's transaction took its snapshot with its first read (p still
    pending). Its success write is nested in it (``succeed``: ``nested``) and
    takes the quick path (``complete_batches(quick=True)``): db/batch_probe.py
    ``SELECT ... WHERE status = 'pending' LIMIT 1 FOR SHARE SKIP LOCKED``
    finds p pending in that snapshot and tries to lock it; p was updated by a
    transaction that committed after the snapshot, and at REPEATABLE READ
    PostgreSQL answers a locking read of such a row with ``could not
    serialize access due to concurrent update`` (SKIP LOCKED skips only rows
    locked right now). The whole handler transaction rolls back: the
    handler's own writes and the success are lost, and the attempt is
    recorded as a failure. Any busy batch (items claimed while another runs)
    makes every atomic handler of it fail so. Expected: the success is
    written (x ``succeeded``), the batch stays open (p is running). Fix: no
    quick path in a caller's transaction (``nested``: pass ``quick=False``,
    the batch row's lock does not conflict), or catch the serialization
    failure of the probe in a savepoint and fall back to the lock.
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


# -- QuerySet.cancel: the batch row's lock, then the claimed rows' -----------------


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


@pytest.mark.server_db
def test_cancelling_a_batch_while_a_worker_finishes_one_of_its_items_does_not_deadlock() -> None:
    """PostgreSQL and MariaDB: an operator cancels a whole batch
    (``WorkItem.objects.filter(batch=b).cancel()``: its pending items end, its claimed
    ones are asked to stop) while a worker writes the success of one of its claimed
    items.

    ``QuerySet.cancel`` is one transaction: ``cancel_pending`` cancels the
    pending item p and settles the batch (``complete_batches``: the batch
    row's lock), then ``request_cancel`` updates the claimed rows, and waits
    for the row s whose success the worker has written and not committed.
    The worker's ending, after its write, probes for a pending item (p is
    locked by the cancel: skipped) and takes the batch row's lock, held by
    the cancel: the cancel holds the batch row and waits for s, the worker
    holds s and waits for the batch row. A deadlock, resolved by aborting
    one of them (``deadlock detected`` / ``Deadlock found when trying to get
    lock``): the operator's cancel or the worker's success write fails. The
    same cycle with any ending of a claimed item (a failure, a stale
    recovery), not only the quick path. SPEC: an operator's cancel is one of
    the endings, and the worker's success "the transaction that records the
    last ending". Expected: both commit, p ``cancelled``, s ``succeeded``,
    one callback. Fix: in ``cancel()``, take the claimed rows'
    locks (``request_cancel``) before ``cancel_pending``'s settle, i.e.
    settle once at the very end of ``cancel()`` (item locks first, batch
    locks last, as every ending takes them); or have ``cancel_pending`` not
    settle when called from ``cancel()`` and settle after ``request_cancel``.
    Since attack s14 ``cancel()`` locks its pending and claimed rows first, so it
    waits for s before it touches p or the batch row.
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
        # worker holds uncommitted, then p), before it cancels or asks any (since
        # attack s14: a retry between its two halves lost the cancel); the worker
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


@pytest.mark.postgres_only
def test_a_transaction_opened_on_commit_of_an_ending_runs_at_the_projects_level() -> None:
    """PostgreSQL, a project at SERIALIZABLE (``OPTIONS["isolation_level"]``): an
    operator cancels the last item of a batch; a ``post_init`` receiver of the callback's
    row (an audit trail) registers ``transaction.on_commit`` work that opens a
    transaction of its own.

    postgresql.py ``_read_committed_transaction`` sets psycopg's
    ``isolation_level`` to READ COMMITTED and restores it in a ``finally``
    *after* ``transaction.atomic`` exits; but Django runs the on_commit
    callbacks inside that exit (``set_autocommit(True)``), so every
    transaction they open begins at READ COMMITTED: the project's
    SERIALIZABLE leaks away from code that is not the library's. (The guide:
    the endings' transactions "run at READ COMMITTED whatever the project
    configures", only they.) Expected: the receiver's transaction runs at
    ``serializable``. Fix: restore the level before the commit hooks run,
    e.g. open the transaction with an explicit ``SET TRANSACTION ISOLATION
    LEVEL READ COMMITTED`` as its first statement (inside the atomic block:
    it lasts for that transaction only) instead of the connection
    attribute, or register the restore as the block's first on_commit
    callback (Django runs them in order) besides the ``finally``.
    """
    import psycopg
    from django.db.models.signals import post_init

    connection.ensure_connection()
    connection.connection.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
    with batch(on_complete=BatchDone) as b:
        last = Noop.enqueue({})
    seen: list[str] = []

    def audit() -> None:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SHOW transaction_isolation")
            seen.append(cursor.fetchone()[0])

    def receiver(sender: Any, instance: WorkItem, **kwargs: Any) -> None:
        if instance.pk is None and instance.handler == BatchDone.name:
            transaction.on_commit(audit)

    post_init.connect(receiver, sender=WorkItem)
    try:
        assert last.cancel()
    finally:
        post_init.disconnect(receiver, sender=WorkItem)
        connection.close()  # the next test's connection gets the default level again
    assert len(callbacks(b.id)) == 1
    assert seen == ["serializable"]


# -- retry: the retried rows' locks, then their parents' ----------------------------


@pytest.mark.server_db
def test_retrying_a_child_while_its_parent_succeeds_does_not_deadlock() -> None:
    """MariaDB: an operator cancelled the waiting child c of a running parent a, then
    retries c (the guide: "A retried child waits again for those of its parents that
    are pending or running") at the moment a's success is written.

    The retry (models.py ``retry``) updates c first, then
    ``dependencies.wait_again`` locks c's parents (``select_for_update`` of
    a). a's ending locks a (its success write) and then its waiting children
    (completion.py ``_resolve``: ``SELECT ... FOR UPDATE`` of c). On InnoDB a
    locking read waits for a row another transaction wrote, whatever its
    WHERE says: the retry holds c and waits for a, the ending holds a and
    waits for c, a deadlock; one of them is rolled back (``Deadlock found
    when trying to get lock``). PostgreSQL evaluates the ``status =
    'pending'`` of the locking read on the old version of c (cancelled) and
    does not wait: it passes there. Expected: both commit, a ``succeeded``,
    c due (not waiting). Fix: lock in one order everywhere, parents before
    children: in ``retry``, lock the retried rows' parents (read the links
    first) before the UPDATE of the retried rows; or take the retried rows
    with ``locked_in_id_order`` together with their parents (parents have
    lower ids than their children).
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


# -- cancel_pending: the cancelled rows' locks, then their children's ----------------


@pytest.mark.server_db
@pytest.mark.xfail(
    strict=True,
    reason="known: an operator's cancel of a parent and a waiting child can deadlock with "
    "another parent's ending; the database rolls one back (a worker's write is retried, "
    "the operator's action shows the error and changed nothing)",
)
def test_cancelling_a_parent_and_a_waiting_child_while_another_parent_succeeds() -> None:
    """PostgreSQL and MariaDB. Two parents a (running) and p (pending); x waits for both
    (a fan-in), w waits for a. The operator cancels p and w (the admin's Cancel on two
    selected rows: ``cancel_pending``) while a's success is written.

    The cancel updates p and w (their locks first), then settles: p's
    dependents, i.e. locks x (completion.py ``_resolve``). a's ending locks
    a, then its waiting children in id order: x, then w, which the cancel
    holds. The ending holds x and waits for w; the cancel holds w and waits
    for x: a deadlock, and one of the two is rolled back (the operator's
    action errors, or the worker's success write is thrown away). The root
    is the lock order: endings lock a parent, then its children ascending,
    level by level; an operator's cancel locks any pending rows, waiting
    children among them, before their dependents. Expected: both commit; x
    cancelled (its parent p was), w cancelled (by the operator), a
    succeeded. Fix: in ``cancel_pending``, lock the waiting rows of the
    selection (and the dependents it will settle) in one ascending order
    with the others before updating; or cancel the waiting rows of the
    selection through ``_resolve``'s order (settle the non-waiting rows
    first, then cancel the waiting ones that are still pending).
    """
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
    errors = []
    for name, step in (("ending", ending), ("operator", operator)):
        try:
            step.outcome()
        except Exception as exc:  # both must commit
            errors.append((name, exc))
    assert not errors, errors
    statuses = dict(WorkItem.objects.values_list("pk", "status"))
    assert statuses == {
        a.pk: Status.SUCCEEDED,
        p.pk: Status.CANCELLED,
        x.pk: Status.CANCELLED,
        w.pk: Status.CANCELLED,
    }


# -- cancel_pending: big selections ----------------------------------------------


@pytest.mark.sqlite_only
def test_cancelling_a_big_batch_on_a_standard_sqlite_build() -> None:
    """SQLite as most builds ship it (``SQLITE_MAX_VARIABLE_NUMBER`` 32,766, the default
    since 3.32; Debian raises it to 250,000, so the test sets the default on its
    connection): an operator cancels the pending items of a batch of 33,000 rows
    (the issue's "run these 10,000 rows" times a few), e.g. ``Batch``'s items.

    models.py ``cancel_pending`` reads the ids and updates them in chunks of
    1,000, but hands every cancelled row of the selection to
    ``_endings.settle`` at once: completion.py ``propagate_rows`` filters
    ``pk__in`` all 33,000 ids in one statement, which SQLite refuses (``too
    many SQL variables``), and the whole cancel rolls back. Expected: the
    33,000 rows are cancelled and the batch completes, one callback. Fix:
    chunk ``propagate_rows``' read (and ``_follow``'s ``parent_id__in``) as
    the UPDATE is chunked, or collect the linked rows per chunk with a
    subquery instead of an id list; the same limit is 65,535 parameters on
    PostgreSQL with ``OPTIONS["server_side_binding"]``.
    """
    import sqlite3

    n = 33_000
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue_many([{}] * n)
    connection.ensure_connection()
    connection.connection.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 32_766)
    try:
        assert WorkItem.objects.filter(batch_id=b.id).cancel() == n
    finally:
        connection.close()
    assert len(callbacks(b.id)) == 1


# -- after= with a unique_key ------------------------------------------------------


def test_an_after_enqueue_that_finds_a_live_unique_key_does_not_hand_back_a_due_row() -> None:
    """``Record.enqueue(payload, unique_key="k", after=[t])`` while a row with key "k" is
    live and due (enqueued earlier without parents).

    enqueuing.py ``_save_after`` locks and checks the parents, then ``_save``
    meets the live key and returns that row (``added`` False): the caller
    asked for an item that runs only after t succeeded and got one that is
    claimed at once, before t has run; no link is written (t is marked
    ``has_dependents`` for nothing). The same reason made unique_key an
    ``EnqueueError`` inside a batch (the guide: "Such an enqueue may return
    the key's live row, which is not the batch's"). SPEC: "after=: the item
    is not claimed until every listed item has succeeded". Expected: an
    ``EnqueueError`` ("unique_key cannot be combined with after=") before
    anything is written, as for ``run_after``; or the guide says that the
    returned row keeps its own parents. Fix: refuse the combination in
    ``insert_one`` beside the ``run_after`` check (or make the returned
    row wait too, which changes another caller's row: refusing is simpler).
    """
    from django_dbworker import EnqueueError

    t = Record.enqueue({"key": "t"})
    live = Record.enqueue({"key": "report"}, unique_key="k")
    try:
        item = Record.enqueue({"key": "report"}, unique_key="k", after=[t])
    except EnqueueError:
        assert sorted(WorkItem.objects.values_list("pk", flat=True)) == [t.pk, live.pk]
        return
    claimed = {row.pk for row in claim(handlers=["record"])}
    assert item.pk not in claimed, (
        f"enqueue(after=[#{t.pk}]) returned #{item.pk} (the live key's row, #{live.pk}), "
        f"claimed beside its parent #{t.pk}: {sorted(claimed)}"
    )


@pytest.mark.mysql_only
def test_an_operator_cancel_in_a_manual_transaction_at_repeatable_read_returns() -> None:
    """MariaDB, a project at REPEATABLE READ (``OPTIONS["isolation_level"]``), in manual
    transaction mode: a script reads a row, cancels it, commits.

    mysql.py ``_read_committed`` (the ending's transaction, through the
    ``_Endings`` port) sees ``in_atomic_block`` False and sends ``SET
    TRANSACTION ISOLATION LEVEL READ COMMITTED`` inside the caller's open
    transaction: MariaDB refuses it (error 1568, "Transaction
    characteristics can't be changed while a transaction is in progress").
    Expected: the cancel works in the caller's transaction, at its level,
    as inside ``atomic()``. Fix: treat ``not connection.get_autocommit()``
    like ``in_atomic_block`` there (and in postgresql.py).
    """
    with connection.cursor() as cursor:
        cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    connection.isolation_level = "repeatable read"  # what Django records at connect
    with batch(on_complete=BatchDone) as b:
        last = Noop.enqueue({})
    transaction.set_autocommit(False)
    try:
        assert WorkItem.objects.get(pk=last.pk).cancel()
        transaction.commit()
    finally:
        transaction.rollback()
        transaction.set_autocommit(True)
        connection.close()
    assert WorkItem.objects.get(pk=last.pk).status == Status.CANCELLED
    assert len(callbacks(b.id)) == 1


# -- an operator's verb inside a caller's stricter transaction -----------------------


def _session_at_repeatable_read() -> None:
    """The session of a project with ``OPTIONS["isolation_level"]`` REPEATABLE READ."""
    connection.ensure_connection()
    if connection.vendor == "postgresql":
        _repeatable_read()
    else:
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        connection.isolation_level = "repeatable read"  # what Django records at connect


@pytest.mark.server_db
def test_a_cancel_in_a_request_transaction_at_repeatable_read_completes_the_batch() -> None:
    """PostgreSQL and MariaDB, a project at REPEATABLE READ with ``ATOMIC_REQUESTS`` (the
    admin's actions then run in the request's transaction): the admin cancels the last
    pending item p of a batch; the request read something first (the session, the
    changelist), and meanwhile a worker committed the success of the batch's other
    item a.

    The worker's ending probed p (pending, not locked) and skipped the batch
    row: p's ending must see a. The cancel runs in ``ending_transaction``,
    which keeps the caller's level inside a caller's transaction: its check
    after the batch row's lock reads the request's snapshot, a still
    claimed, and does not complete the batch; nothing settles it again
    after the request commits (``propagate_after_commit`` is only in
    ``succeed``, for atomic handlers). No callback until a worker's sweep
    (up to ``STALE_AFTER / 4``, 15 s by default). The guide ("What it
    costs", Isolation): the endings' reads after a lock must see what the
    lock's previous holder committed, "whatever the project configures".
    Expected: the callback once the request commits. Fix: in the operator
    verbs (``cancel_pending``, ``retry``'s ``rewait``), when
    ``ending_transaction`` joined a caller's transaction, also register
    ``completion.propagate_after_commit`` for the rows they ended (as
    ``succeed`` does for a nested write).
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

    request = Racer(admin_request, session=_session_at_repeatable_read)
    assert ready.wait(TIMEOUT)
    assert succeed(a) == {(a.pk, a.claim_token)}  # the worker, committed
    go.set()
    assert request.outcome() == 1
    assert len(callbacks(b.id)) == 1, "every item ended and no callback was enqueued"


# -- the worker's stale-recovery pass: one transaction at the session's level ----------


@pytest.mark.server_db
def test_stale_recovery_failing_the_last_item_at_repeatable_read_completes_the_batch() -> None:
    """PostgreSQL and MariaDB, a project at REPEATABLE READ: the worker that ran item x of
    a batch died (x used its last attempt); a stale-recovery pass fails x while another
    worker's success of the batch's other item a is being committed.

    The worker runs the whole pass in one ``transaction.atomic`` of its own
    (worker/recovery.py, around ``transitions.recover_stale``): at the
    session's level, not ``ending_transaction``'s READ COMMITTED; the
    ending inside it (``recover_stale``'s ``ending_transaction``) is nested
    and keeps that level. The pass's snapshot is taken by its first read
    (the stale rows; a still claimed). a's ending holds the batch row's
    lock (it saw x claimed); the pass fails x, waits for the batch row, and
    once a's success commits reads the items in its old snapshot: a
    claimed, no completion; its ``sweep`` at the end reads the same
    snapshot. No callback until the next pass of some worker (``STALE_AFTER
    / 4`` later), not in the transaction of the last ending (issue 22; the
    guide: the endings run at READ COMMITTED "whatever the project
    configures"). Expected: one callback once the pass commits. Fix: open
    the pass's transaction with ``operations(using).ending_transaction()``
    instead of ``transaction.atomic`` in recovery.py.
    """
    batch_id, (a, x) = claimed_batch_of_two()
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
        # As worker/recovery.py runs it (since the fix: ending_transaction, READ COMMITTED).
        with operations("default").ending_transaction():
            return transitions.recover_stale(stale_after=60, using="default", log=False).failed

    read = threading.Event()

    def recovery_pass_signalled() -> int:
        with _signal_after("django_dbworker_workitem", read):  # the pass's snapshot
            return recovery_pass()

    recovery = Racer(recovery_pass_signalled, session=_session_at_repeatable_read)
    assert read.wait(TIMEOUT)
    go.set()
    finisher.outcome()
    assert recovery.outcome() == 1
    statuses = sorted(WorkItem.objects.filter(batch_id=batch_id).values_list("status", flat=True))
    assert statuses == [Status.FAILED, Status.SUCCEEDED]
    assert len(callbacks(batch_id)) == 1, "every item ended and no callback was enqueued"


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


def claimed_batch_of_two() -> tuple[int, tuple[WorkItem, WorkItem]]:
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue_many([{}, {}])
    a, x = sorted(claim(limit=2, handlers=["noop"]), key=lambda i: i.pk)
    return b.id, (a, x)


@pytest.mark.server_db
def test_a_recovery_pass_of_several_chunks_does_not_deadlock_with_a_zombies_success() -> None:
    """PostgreSQL and MariaDB: a stale-recovery pass over more stale rows than one chunk
    (``RECOVERY_BATCH``, 500; 1 here) while a zombie worker (alive, heartbeat late) writes
    the success of one of them. x1 and x2 are items of one batch: x1 used its last
    attempt, x2 is x1's neighbour in the next chunk and the zombie's.

    The worker runs the whole pass in one transaction (worker/recovery.py),
    so the locks of every chunk are held to its end: chunk 1 fails x1 and
    settles its batch (the batch row's lock); chunk 2 updates x2, which the
    zombie's success write holds: the pass waits for the zombie. The
    zombie's ending, after its write, takes the batch row's lock, held by
    the pass: a deadlock, one of them rolled back (the whole pass, or the
    zombie's success). recover_stale's comment says its locks are "taken in
    one ascending order, as every other bulk writer takes them, so recovery
    cannot deadlock with them"; the batch rows' locks taken between chunks
    break that order. Expected: both commit (x2's success kept, x1
    failed). Fix: in ``recover_stale``, settle the ended rows of every
    chunk once, after the last chunk's writes (collect ``ended`` and call
    ``propagate_rows`` at the end), so that the batch rows are locked last;
    or commit per chunk.
    """
    batch_id, (x1, x2) = claimed_batch_of_two()
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
        # As worker/recovery.py runs it (since the fix: ending_transaction, READ COMMITTED).
        with operations("default").ending_transaction():
            return transitions.recover_stale(
                stale_after=60, using="default", log=False, batch_size=1
            )

    locked = threading.Event()

    def recovery_pass_signalled() -> Any:
        with _signal_after("django_dbworker_batch", locked):  # chunk 1 settled: batch locked
            return recovery_pass()

    recovery = Racer(recovery_pass_signalled)
    # Before the fix the pass locked the batch row after chunk 1 (``locked``), then
    # waited for x2: a deadlock once the zombie went on. Since, it waits for x2 first.
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
