"""Attack (session 7) on a queue database of its own: ``run_workers`` on the ``work`` alias.

With the work tables on a database of their own, the handlers' data is on
another one (``default``): the very case the queue database exists for. The
worker tidies and checks only the connection of the alias its rows are on, so
a handler thread's connection to ``default`` that the server dropped between
jobs (a failover, ``pg_terminate_backend``, a proxy's idle timeout) is never
closed and reopened: every later job of that thread fails on it, each attempt
with "the connection is closed", until the item ends ``failed``. With the work
on ``default`` (the control test) the same kill costs nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from django_dbworker import enqueue
from django_dbworker.models import WorkItem
from tests.conftest import kill_other_connections, wait_until
from tests.routers import WORK_ALIAS
from tests.testapp.models import Execution, Invoice

pytestmark = [
    pytest.mark.server_db,
    pytest.mark.django_db(transaction=True, databases=["default", WORK_ALIAS]),
]


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


def test_a_handler_thread_survives_losing_its_default_connection_on_a_queue_database(
    routed: None, queue_env: dict[str, str], start_worker: Callable[..., Any]
) -> None:
    done = _a_dropped_default_connection(WORK_ALIAS, queue_env, start_worker)
    assert done.status == "succeeded", (done.attempts, done.last_error[:300])
    assert Execution.objects.filter(key="second").count() == 1


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


def test_an_own_table_loop_survives_losing_its_default_connection_on_a_queue_database(
    routed: None, queue_env: dict[str, str], start_worker: Callable[..., Any]
) -> None:
    _own_table_after_a_dropped_connection(queue_env, start_worker)


def test_control_the_own_table_loop_with_the_work_on_default(
    worker_env: dict[str, str], start_worker: Callable[..., Any]
) -> None:
    _own_table_after_a_dropped_connection(worker_env, start_worker)


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
