"""``run_workers`` on a queue database of its own: claims, outcomes, batches, wake-ups.

The subprocess runs with ``DATABASE_ROUTERS = ["tests.routers.QueueOnWork"]``
(the shipped ``QueueRouter`` on the ``work`` alias, a second database of the
same server): every row it claims and records is there, and it leaves the
work tables of ``default`` untouched, not read, not written (on PostgreSQL,
the server's own table statistics say so). Its wake-ups are LISTENed to on
the queue database, where enqueues NOTIFY.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connections

from django_dbworker import batch, enqueue
from django_dbworker.batches.models import Batch, Dependency
from django_dbworker.flow.models import QueueState
from django_dbworker.models import PeriodicSchedule, WorkItem
from tests.conftest import kill_other_connections, wait_until
from tests.routers import WORK_ALIAS
from tests.testapp.models import Execution, Invoice
from tests.testapp.workers import Echo, Noop, NoRetry

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", WORK_ALIAS])

WORK_MODELS = (WorkItem, Batch, Dependency, QueueState, PeriodicSchedule)


def _other_backends(alias: str) -> int:
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return int(cursor.fetchone()[0])


def _default_work_table_activity() -> int | None:
    """Scans, inserts, updates and deletes the server counted on default's work tables.

    None off PostgreSQL. Read once no other session is connected to default:
    a session's counts reach the statistics when it ends, at the latest (this
    test's own session too: it starts a new one).
    """
    if connections["default"].vendor != "postgresql":
        return None
    connections["default"].close()
    wait_until(lambda: _other_backends("default") == 0, timeout=30, what="default to be idle")
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT coalesce(sum(coalesce(seq_scan, 0) + coalesce(idx_scan, 0) + n_tup_ins"
            " + n_tup_upd + n_tup_del), 0) FROM pg_stat_user_tables"
            " WHERE relname LIKE 'django\\_dbworker\\_%%'"
        )
        return int(cursor.fetchone()[0])


def _nothing_on_default() -> None:
    for model in WORK_MODELS:
        assert not model.objects.using("default").exists(), model.__name__


def test_a_burst_runs_the_queue_databases_work_and_leaves_default_alone(
    routed: None, queue_env: dict[str, str], start_worker: Callable[..., Any]
) -> None:
    items = Noop.enqueue_many([{"n": n} for n in range(5)])
    child = Noop.enqueue({"n": "child"}, after=[items[0]])
    with batch(on_complete=Echo, payload={"import": 7}) as b:
        Noop.enqueue_many([{"n": "in batch"}, {"n": "in batch too"}])
    # Its handler writes to default (the project's table); its failure is the queue's.
    failing = NoRetry.enqueue({"key": "fails"})
    before = _default_work_table_activity()

    worker = start_worker(
        "noop", "echo", "no_retry", "--burst", "--concurrency", "2", env=queue_env
    )
    assert worker.wait(60) == 0, worker.log()

    assert "alias=work" in worker.log(), worker.log()
    done = WorkItem.objects.using(WORK_ALIAS)
    failed = done.get(pk=failing.pk)
    assert failed.status == "failed" and "not a retryable error" in failed.last_error
    assert Execution.objects.filter(key="fails").count() == 1
    done = done.exclude(pk=failing.pk)
    assert set(done.values_list("status", flat=True)) == {"succeeded"}, worker.log()
    assert done.count() == len(items) + 1 + 2 + 1  # the batch's callback too
    assert done.get(pk=child.pk).status == "succeeded"
    finished = Batch.objects.using(WORK_ALIAS).get(pk=b.pk)
    assert finished.completed_at is not None
    callback = done.get(pk=finished.callback_id)
    assert callback.payload["succeeded"] == 2
    assert _default_work_table_activity() == before
    _nothing_on_default()


@pytest.mark.postgres_only
def test_wakeups_are_listened_to_on_the_queue_database(
    routed: None, queue_env: dict[str, str], start_worker: Callable[..., Any]
) -> None:
    before = _default_work_table_activity()
    # A 30 s poll: only a wake-up can bring the item to the worker in time.
    worker = start_worker("noop", env={**queue_env, "DBWORKER_POLL_INTERVAL": "30"})

    def listening(alias: str) -> int:
        with connections[alias].cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE btrim(query, E' \\n') = 'LISTEN django_dbworker'"
                " AND datname = current_database()"
            )
            return int(cursor.fetchone()[0])

    wait_until(lambda: listening(WORK_ALIAS) == 1, timeout=30, what="the worker to LISTEN")
    assert listening("default") == 0
    item = Noop.enqueue({"n": 1})
    wait_until(
        lambda: WorkItem.objects.using(WORK_ALIAS).filter(pk=item.pk, status="succeeded").exists(),
        timeout=10,
        what="the woken worker to run the item",
    )
    worker.signal(15)
    assert worker.wait(30) == 0, worker.log()
    assert _default_work_table_activity() == before
    _nothing_on_default()


# -- a handler thread's connection to default that the server dropped --------------------
#
# With the work tables on a database of their own, the handlers' data is on another
# one (``default``). A handler thread's connection to ``default`` that the server dropped
# between jobs (a failover, ``pg_terminate_backend``, a proxy's idle timeout) is closed and
# reopened before the next job, as with the work on ``default`` (the control tests).


def _finished(alias: str, pk: int) -> WorkItem | None:
    row = WorkItem.objects.using(alias).get(pk=pk)
    return row if row.status in ("succeeded", "failed") else None


def _a_dropped_default_connection(
    alias: str, env: dict[str, str], start_worker: Callable[..., Any]
) -> WorkItem:
    """One thread runs ``record`` (it writes to default) once, loses its default
    connection while idle, then runs ``record`` again with three attempts."""
    worker = start_worker("record", "--concurrency", "1", env=env)
    first = enqueue("record", {"key": "first"})
    wait_until(lambda: _finished(alias, first.pk), timeout=30, what="the first item")
    assert Execution.objects.filter(key="first").count() == 1, worker.log()
    # The handler thread's connection to default (the worker's only one there when
    # the work is elsewhere; with the work on default its claim loop's too).
    assert kill_other_connections() >= 1
    second = enqueue("record", {"key": "second"}, max_attempts=3)
    done = wait_until(lambda: _finished(alias, second.pk), timeout=60, what="the second item")
    worker.signal(15)
    assert worker.wait(30) == 0, worker.log()
    return done


@pytest.mark.server_db
def test_a_handler_thread_survives_losing_its_default_connection_on_a_queue_database(
    routed: None, queue_env: dict[str, str], start_worker: Callable[..., Any]
) -> None:
    done = _a_dropped_default_connection(WORK_ALIAS, queue_env, start_worker)
    assert done.status == "succeeded", (done.attempts, done.last_error[:300])
    assert Execution.objects.filter(key="second").count() == 1


@pytest.mark.server_db
def test_control_the_same_kill_with_the_work_on_default(
    worker_env: dict[str, str], start_worker: Callable[..., Any]
) -> None:
    done = _a_dropped_default_connection("default", worker_env, start_worker)
    assert done.status == "succeeded", (done.attempts, done.last_error[:300])


def _own_table_after_a_dropped_connection(
    env: dict[str, str], start_worker: Callable[..., Any]
) -> None:
    """``invoice-mailer`` (a ``Handler[Invoice]`` over default's own table) sends one
    invoice, loses its connections to default, and must send the next one."""
    worker = start_worker("invoice-mailer", env=env)
    first = Invoice.objects.create()
    wait_until(
        lambda: Invoice.objects.filter(pk=first.pk, status="sent").exists(),
        timeout=30,
        what="the first invoice to be sent",
    )
    assert kill_other_connections() >= 1
    second = Invoice.objects.create()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if Invoice.objects.filter(pk=second.pk, status="sent").exists():
            break
        time.sleep(0.1)
    worker.signal(15)
    assert worker.wait(30) == 0, worker.log()
    errors = [line for line in worker.log().splitlines() if "Error:" in line]
    assert Invoice.objects.get(pk=second.pk).status == "sent", (len(errors), errors[-1:])


@pytest.mark.server_db
def test_an_own_table_loop_survives_losing_its_default_connection_on_a_queue_database(
    routed: None, queue_env: dict[str, str], start_worker: Callable[..., Any]
) -> None:
    _own_table_after_a_dropped_connection(queue_env, start_worker)


@pytest.mark.server_db
def test_control_the_own_table_loop_with_the_work_on_default(
    worker_env: dict[str, str], start_worker: Callable[..., Any]
) -> None:
    _own_table_after_a_dropped_connection(worker_env, start_worker)


@pytest.mark.server_db
def test_schedules_rates_keys_and_cancel_all_live_on_the_queue_database(
    routed: None, queue_env: dict[str, str], start_worker: Callable[..., Any]
) -> None:
    """Periodic slots, rate-limit starts, concurrency-key slots and a cancel of a running
    item: every row they need is on the queue database, none on default."""
    from django_dbworker.flow.models import FlowLock, QueueState, RateStart
    from django_dbworker.models import PeriodicSchedule
    from tests.testapp.workers import Keyed, Rated, StopWhenCancelled

    rated = Rated.enqueue_many([{"key": f"r{n}"} for n in range(3)])
    keyed = [Keyed.enqueue({"key": "k", "seconds": 0.05}, concurrency_key="k") for _ in range(3)]
    running = StopWhenCancelled.enqueue({"key": "c"})
    worker = start_worker("tick", "rated", "keyed", "stop_when_cancelled", env=queue_env)
    work = WorkItem.objects.using(WORK_ALIAS)
    wait_until(
        lambda: Execution.objects.filter(kind="tick").count() >= 2,
        timeout=30,
        what="two ticks",
    )
    wait_until(lambda: Execution.objects.filter(key="c", kind="run").exists(), timeout=30, what="c")
    assert work.get(pk=running.pk).cancel()
    wait_until(lambda: work.get(pk=running.pk).status == "cancelled", timeout=30, what="the cancel")
    ids = [i.pk for i in [*rated, *keyed]]
    wait_until(
        lambda: work.filter(pk__in=ids, status="succeeded").count() == len(ids),
        timeout=30,
        what="the rated and keyed items",
    )
    worker.signal(15)
    assert worker.wait(30) == 0, worker.log()
    assert PeriodicSchedule.objects.using(WORK_ALIAS).filter(name="tick").exists()
    assert work.filter(handler="tick", status="succeeded").count() >= 2
    for model in (WorkItem, PeriodicSchedule, QueueState, FlowLock, RateStart):
        assert not model.objects.using("default").exists(), model.__name__
