"""Running items through handlers: outcomes, retries, errors, the testing helpers."""

from __future__ import annotations

import gc
import logging
import re
import warnings

import pytest
from django.db import connection
from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext

from django_dbworker.models import Status, WorkItem
from django_dbworker.testing import assert_enqueued, enqueued, run_until_empty
from django_dbworker.worker.runtime import Worker, WorkerConfig
from tests.factories import claim, make_due
from tests.testapp.models import Execution
from tests.testapp.workers import (
    AlwaysFail,
    BadResult,
    Echo,
    Flaky,
    Noop,
    NoRetry,
    ReturnsCoroutine,
    Secret,
    SystemExiter,
    Urgent,
)

pytestmark = pytest.mark.django_db


def test_success_records_the_return_value() -> None:
    item = Echo.enqueue({"hello": "world"})
    assert run_until_empty() == {"succeeded": 1}
    row = WorkItem.objects.get(pk=item.pk)
    assert row.status == Status.SUCCEEDED and row.result == {"hello": "world"}
    assert row.attempts == 1 and row.finished_at is not None


@pytest.mark.usefixtures("slow_retries")
def test_failures_retry_with_backoff_until_success() -> None:
    item = Flaky.enqueue({"key": "f", "fail_times": 2})
    assert run_until_empty() == {"retried": 1}
    row = WorkItem.objects.get(pk=item.pk)
    assert row.status == Status.PENDING and row.attempts == 1
    assert row.last_error.startswith("ConnectionError: flaky failure 1")
    assert "Traceback" in row.last_error
    assert WorkItem.objects.filter(pk=item.pk, run_after__gt=Now()).exists()  # backoff
    make_due()
    assert run_until_empty() == {"retried": 1}
    make_due()
    assert run_until_empty() == {"succeeded": 1}
    row.refresh_from_db()
    assert (row.status, row.attempts, row.result) == (Status.SUCCEEDED, 3, 3)


@pytest.mark.usefixtures("slow_retries")
def test_attempts_used_up_end_failed() -> None:
    item = AlwaysFail.enqueue({"key": "a"})
    run_until_empty()
    make_due()
    assert run_until_empty() == {"failed": 1}
    row = WorkItem.objects.get(pk=item.pk)
    assert (row.status, row.attempts) == (Status.FAILED, 2)
    assert row.last_error.startswith("ValueError: always fails")
    assert Execution.objects.filter(key="a").count() == 2


def test_exceptions_outside_retry_on_fail_at_once() -> None:
    item = NoRetry.enqueue({"key": "n"})
    assert run_until_empty() == {"failed": 1}
    row = WorkItem.objects.get(pk=item.pk)
    assert row.status == Status.FAILED and row.attempts == 1


def test_system_exit_in_a_handler_is_a_failure_not_an_exit() -> None:
    item = SystemExiter.enqueue({})
    assert run_until_empty() == {"failed": 1}
    assert WorkItem.objects.get(pk=item.pk).last_error.startswith("SystemExit: 3")


def test_a_result_that_is_not_json_fails_the_item() -> None:
    item = BadResult.enqueue({})
    assert run_until_empty() == {"failed": 1}
    assert "return value is not JSON-serialisable" in WorkItem.objects.get(pk=item.pk).last_error


def test_a_coroutine_returned_by_a_sync_handle_fails_the_item_at_once_unrun() -> None:
    item = ReturnsCoroutine.enqueue({"key": "c"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "coroutine ... was never awaited"
        assert run_until_empty() == {"failed": 1}
        gc.collect()
    row = WorkItem.objects.get(pk=item.pk)
    assert row.attempts == 1, "retrying would return another coroutine"
    assert "returned a coroutine" in row.last_error and "async def" in row.last_error
    assert not Execution.objects.filter(key="c").exists()


def test_sensitive_payloads_stay_out_of_logs(caplog: pytest.LogCaptureFixture) -> None:
    Secret.enqueue({"password": "hunter2"})
    with caplog.at_level(logging.DEBUG, logger="django_dbworker"):
        assert run_until_empty() == {"failed": 1}
    assert caplog.records, "the failure should be logged"
    assert "hunter2" not in caplog.text


def test_priorities_and_queues_drive_the_order() -> None:
    Urgent.enqueue({"key": "low"}, priority=-1)
    Urgent.enqueue({"key": "high"}, priority=50)
    Urgent.enqueue({"key": "other-queue"}, queue="elsewhere")
    run_until_empty(queues=["urgent"])
    assert list(Execution.objects.order_by("id").values_list("key", flat=True)) == ["high", "low"]
    assert run_until_empty(handlers=["urgent"]) == {"succeeded": 1}


def test_testing_helpers_inspect_enqueued_work() -> None:
    Echo.enqueue({"n": 1})
    Echo.enqueue({"n": 2})
    assert enqueued(Echo).count() == 2
    assert_enqueued("echo", {"n": 2})
    assert_enqueued(Echo, count=2)
    with pytest.raises(AssertionError, match="No pending 'echo' item with payload"):
        assert_enqueued(Echo, {"n": 3})
    with pytest.raises(AssertionError, match="Expected 1 pending"):
        assert_enqueued(Echo, count=1)
    with pytest.raises(AssertionError, match="No pending 'noop' item was enqueued"):
        assert_enqueued(Noop)
    with pytest.raises(ValueError, match="Unknown handler"):
        run_until_empty(handlers=["missing"])


@pytest.mark.django_db(transaction=True)
def test_query_budget_of_one_claim_process_record_cycle() -> None:
    """The worker's own path: claim (1 statement), noop handler, success (1 statement).

    Driven through the real ``Worker`` (inline, burst, as run_until_empty
    runs it), in autocommit as the worker runs. Around the cycle: one
    stale-recovery pass (one SELECT, the two of ``completion.sweep``: open
    batches and waiting rows with nothing left to wait for, and the DELETE of
    dead workers' register rows), the fair rotation's look for fair keys, and
    the claim that finds nothing left.
    """
    Noop.enqueue_many([None] * 3)
    worker = Worker([Noop], WorkerConfig(inline=True, burst=True))
    with CaptureQueriesContext(connection) as ctx:
        worker.run()
    control = ("BEGIN", "COMMIT", "SAVEPOINT", "RELEASE")  # SQLite's show up, PostgreSQL's not
    sql = [q["sql"] for q in ctx.captured_queries if not q["sql"].startswith(control)]
    # The recovery pass's DELETE of dead workers' register rows, under its lock-wait bound
    # (a statement on PostgreSQL; a set and a restore on MySQL): once per pass, not per item.
    register = [q for q in sql if "django_dbworker_liveworker" in q]
    bound = [q for q in sql if re.search(r"lock_(wait_)?timeout", q)]
    assert len(register) == 1 and register[0].startswith("DELETE") and len(bound) <= 2, sql
    sql = [q for q in sql if q not in register and q not in bound]
    # The fair rotation's look for fair keys: none, so not again for a poll interval.
    fair = [q for q in sql if "django_dbworker_fairkey" in q]
    assert len(fair) == 1, sql
    sql = [q for q in sql if q not in fair]
    assert worker.outcomes == {"succeeded": 3}
    claims = [q for q in sql if re.search(r'claimed_by[`"]?\s*=', q)]
    successes = [q for q in sql if "= 'succeeded'" in q]
    if connection.vendor == "mysql":
        # No UPDATE ... RETURNING: a claim locks (SELECT ... SKIP LOCKED), marks
        # and reads back; a success locks and writes. Still constant per cycle.
        locks = [q for q in sql if "SKIP LOCKED" in q]
        assert len(locks) == 4, sql  # one per item, one that finds nothing
        assert len(claims) == 3, sql
        assert len(successes) == 3, sql
        assert len(sql) == 3 + 4 + 3 * 2 + 3 * 2, sql
        return
    assert len(claims) == 4, sql  # one per item, one that finds nothing
    assert len(successes) == 3, sql
    assert len(sql) == 3 + 4 + 3, sql  # the recovery SELECTs, claims, successes


def test_query_budget_does_not_grow_with_the_batch() -> None:
    Noop.enqueue_many([None] * 20)
    with CaptureQueriesContext(connection) as ctx:
        items = claim(limit=20, handlers=["noop"])
    # MySQL: the locking SELECT, the UPDATE and the read-back, whatever the batch.
    expected = 3 if connection.vendor == "mysql" else 1
    assert len(items) == 20 and len(ctx.captured_queries) == expected
