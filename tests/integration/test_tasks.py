"""Django's Tasks contract against ``DBWorkerBackend``, run by the real worker in-process.

The same tests run on Django 5.2 with the ``django-tasks`` backport and on
Django 6 with ``django.tasks`` (scripts/test's third leg), on PostgreSQL and
SQLite.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.db import transaction
from django.utils import timezone

from django_dbworker.models import WorkItem
from django_dbworker.tasks import DBWorkerBackend
from django_dbworker.tasks.compat import (
    InvalidTask,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_backends,
    task_enqueued,
    task_finished,
    task_started,
)
from django_dbworker.testing import run_until_empty
from tests.testapp import tasks
from tests.testapp.models import Effect, Execution
from tests.testapp.workers import Echo

pytestmark = pytest.mark.django_db

try:
    from django.tasks.exceptions import TaskResultMismatch
except ImportError:  # Django 5.2
    from django_tasks.exceptions import TaskResultMismatch  # type: ignore[no-redef]


@pytest.fixture
def signals() -> Any:
    """Every task signal sent while the test runs, as (signal name, status, id)."""
    sent: list[tuple[str, str, str]] = []

    def receiver(name: str) -> Any:
        def record(sender: Any, task_result: Any, **kwargs: Any) -> None:
            assert issubclass(sender, DBWorkerBackend)
            sent.append((name, str(task_result.status), task_result.id))

        return record

    receivers = {
        "enqueued": receiver("enqueued"),
        "started": receiver("started"),
        "finished": receiver("finished"),
    }
    task_enqueued.connect(receivers["enqueued"])
    task_started.connect(receivers["started"])
    task_finished.connect(receivers["finished"])
    yield sent
    task_enqueued.disconnect(receivers["enqueued"])
    task_started.disconnect(receivers["started"])
    task_finished.disconnect(receivers["finished"])


def test_backend_features_are_as_documented() -> None:
    backend = task_backends["default"]
    assert isinstance(backend, DBWorkerBackend)
    assert backend.supports_defer and backend.supports_priority
    assert backend.supports_get_result and backend.supports_async_task


def test_a_task_goes_from_ready_to_successful(signals: list[Any]) -> None:
    result = tasks.add.enqueue(2, 3)
    assert result.status == TaskResultStatus.READY
    assert result.enqueued_at is not None and result.started_at is None
    assert (result.args, result.kwargs, result.backend) == ([2, 3], {}, "default")
    row = WorkItem.objects.get(pk=int(result.id))
    assert row.handler == "tests.testapp.tasks.add"
    assert row.payload == {"args": [2, 3], "kwargs": {}}
    assert signals == [("enqueued", "READY", result.id)]

    assert run_until_empty() == {"succeeded": 1}
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.is_finished
    assert result.return_value == 5
    assert result.started_at is not None and result.finished_at is not None
    assert result.last_attempted_at == result.started_at
    assert result.enqueued_at <= result.started_at <= result.finished_at
    row.refresh_from_db()
    assert result.attempts == 1 and result.worker_ids == [row.claimed_by] != [""]
    assert result.errors == []
    assert signals[1:] == [("started", "RUNNING", result.id), ("finished", "SUCCESSFUL", result.id)]


def test_get_result_reads_any_task_and_refuses_the_rest() -> None:
    backend = task_backends["default"]
    result = tasks.echo.enqueue(1, "two", three=[3])
    fetched = backend.get_result(result.id)
    assert fetched.task.func is tasks.echo.func
    assert (fetched.args, fetched.kwargs) == ([1, "two"], {"three": [3]})
    assert tasks.echo.get_result(result.id).id == result.id
    with pytest.raises(TaskResultMismatch):
        tasks.add.get_result(result.id)
    handler_row = Echo.enqueue({"not": "a task"})
    for unknown in ("999999999", "abc", "", "-1", "1e3", str(handler_row.pk)):
        with pytest.raises(TaskResultDoesNotExist):
            backend.get_result(unknown)


@pytest.mark.usefixtures("slow_retries")
def test_a_failing_task_retries_and_keeps_every_error() -> None:
    result = tasks.flaky.enqueue("f", fail_times=2)
    run_until_empty()
    result.refresh()
    assert result.status == TaskResultStatus.READY  # waiting for its retry
    assert result.attempts == 1 and len(result.errors) == 1
    run_until_empty(include_scheduled=True)
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    # The context saw the right attempt and the two earlier errors.
    assert result.return_value == {"attempt": 3, "errors": 2}
    assert result.attempts == 3 and len(result.worker_ids) == 3
    assert [e.exception_class_path for e in result.errors] == ["builtins.ConnectionError"] * 2
    assert result.errors[0].exception_class is ConnectionError
    assert "flaky failure 1" in result.errors[0].traceback
    assert "flaky failure 2" in result.errors[1].traceback
    assert "Traceback" in result.errors[1].traceback
    assert Execution.objects.filter(key="f").count() == 3


def test_a_task_that_keeps_failing_ends_failed(signals: list[Any]) -> None:
    result = tasks.always_fails.enqueue("x")
    run_until_empty(include_scheduled=True)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and result.is_finished
    assert result.attempts == 2 and len(result.errors) == 2
    assert {e.exception_class for e in result.errors} == {ValueError}
    with pytest.raises(ValueError, match="Task failed"):
        result.return_value  # noqa: B018
    assert WorkItem.objects.get(pk=int(result.id)).max_attempts == 2
    # started per attempt, finished once: a retried attempt has not finished the task.
    kinds = [name for name, _, _ in signals]
    assert kinds == ["enqueued", "started", "started", "finished"]
    assert signals[-1][1] == "FAILED"


def test_context_has_the_result_of_this_attempt() -> None:
    result = tasks.whoami.enqueue("ctx")
    run_until_empty()
    result.refresh()
    seen = result.return_value
    assert seen["attempt"] == 1 and seen["id"] == result.id
    assert seen["status"] == "RUNNING" and seen["worker_ids"] == result.worker_ids


def test_priority_run_after_and_queue_are_honoured() -> None:
    low = tasks.record.using(priority=-5).enqueue("low")
    high = tasks.record.using(priority=50).enqueue("high")
    later = tasks.record.using(run_after=timezone.now() + timedelta(hours=1)).enqueue("later")
    other = tasks.record.using(queue_name="other").enqueue("other")
    rows = {r.pk: r for r in WorkItem.objects.all()}
    assert rows[int(low.id)].priority == -5 and rows[int(high.id)].priority == 50
    assert rows[int(other.id)].queue == "other" and rows[int(low.id)].queue == "tasks"
    assert run_until_empty(queues=["tasks"]) == {"succeeded": 2}
    order = list(Execution.objects.order_by("id").values_list("key", flat=True))
    assert order == ["high", "low"]
    assert task_backends["default"].get_result(later.id).status == TaskResultStatus.READY
    assert task_backends["default"].get_result(other.id).status == TaskResultStatus.READY
    assert task_backends["default"].get_result(high.id).task.priority == 50


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"priority": 101}, "priority"),
        ({"priority": -101}, "priority"),
        ({"queue_name": "nope"}, "Queue 'nope' is not valid"),
        ({"run_after": timezone.now().replace(tzinfo=None)}, "aware"),
    ],
)
def test_invalid_tasks_are_refused_before_anything_is_written(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidTask, match=message):
        tasks.add.using(**change).enqueue(1, 2)
    assert not WorkItem.objects.exists()


def test_arguments_that_json_cannot_hold_raise_djangos_error() -> None:
    with pytest.raises(TypeError, match="Unsupported type"):
        tasks.echo.enqueue(object())
    assert not WorkItem.objects.exists()


def test_a_task_enqueued_in_a_rolled_back_transaction_never_runs() -> None:
    with transaction.atomic():
        tasks.record.enqueue("ghost")
        assert WorkItem.objects.count() == 1
        transaction.set_rollback(True)
    assert not WorkItem.objects.exists()
    assert run_until_empty() == {}
    assert not Execution.objects.exists()


def test_async_tasks_run_on_the_worker() -> None:
    result = async_to_sync(tasks.async_add.aenqueue)(20, 22)
    run_until_empty()
    fetched = async_to_sync(tasks.async_add.aget_result)(result.id)
    assert fetched.status == TaskResultStatus.SUCCESSFUL and fetched.return_value == 42


def test_unique_key_returns_the_live_result() -> None:
    first = tasks.rebuild.enqueue("index")
    again = tasks.rebuild.enqueue("index")
    other = tasks.rebuild.enqueue("other")
    assert again.id == first.id != other.id
    assert WorkItem.objects.count() == 2
    run_until_empty()
    assert tasks.rebuild.enqueue("index").id != first.id  # the first one finished


def test_sensitive_tasks_keep_their_arguments_out_of_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    result = tasks.secret.enqueue("hunter2")
    run_until_empty(include_scheduled=True)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and len(result.errors) == 3
    for error in result.errors:
        assert error.exception_class is ValueError
        assert "hunter2" not in error.traceback and "[redacted]" in error.traceback
    assert "hunter2" not in WorkItem.objects.get(pk=int(result.id)).last_error
    assert "hunter2" not in caplog.text


def test_a_return_value_json_cannot_hold_fails_without_a_retry() -> None:
    result = tasks.not_json.enqueue()
    run_until_empty()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and result.attempts == 1
    assert "result could not be stored" in result.errors[0].traceback


def test_atomic_tasks_commit_their_writes_only_with_their_success() -> None:
    tasks.atomic_effect.enqueue("kept", False)
    failed = tasks.atomic_effect.enqueue("undone", True)
    run_until_empty()
    assert list(Effect.objects.values_list("key", flat=True)) == ["kept"]
    assert task_backends["default"].get_result(failed.id).status == TaskResultStatus.FAILED


def test_a_cancelled_task_reads_failed_with_an_error_that_says_so() -> None:
    result = tasks.add.enqueue(1, 1)
    assert WorkItem.objects.filter(pk=int(result.id)).cancel() == 1
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[-1].exception_class_path == "django_dbworker.errors.Cancelled"
    assert result.errors[-1].exception_class.__name__ == "Cancelled"


def test_backend_options_are_the_defaults_of_its_tasks() -> None:
    result = tasks.patient.enqueue("p")
    row = WorkItem.objects.get(pk=int(result.id))
    assert row.max_attempts == 4  # OPTIONS MAX_ATTEMPTS of the "patient" backend
    from django_dbworker.registry import registry

    assert registry["tests.testapp.tasks.patient"].timeout == 30
    run_until_empty(include_scheduled=True)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and result.attempts == 4


def test_tasks_and_handler_classes_run_side_by_side() -> None:
    tasks.add.enqueue(1, 2)
    Echo.enqueue({"a": 1})
    assert run_until_empty() == {"succeeded": 2}


def test_bad_backend_settings_are_system_check_errors() -> None:
    backend = DBWorkerBackend(
        "broken",
        {"QUEUES": ["ok", "not a queue!"], "OPTIONS": {"MAX_ATTEMPTS": 0, "RETRIES": 3}},
    )
    ids = sorted(message.id for message in backend.check())
    assert ids == ["django_dbworker.E016", "django_dbworker.E016", "django_dbworker.E017"]
    assert list(task_backends["default"].check()) == []


def test_task_options_are_validated_at_declaration() -> None:
    from django_dbworker.tasks import task

    def module_level(x: int) -> int:
        return x

    module_level.__qualname__ = "module_level"
    for options, message in [
        ({"max_attempts": 0}, "max_attempts"),
        ({"timeout": -1}, "timeout"),
        ({"atomic": "yes"}, "atomic"),
        ({"unique_key": ""}, "unique_key"),
        ({"fair_key": ""}, "fair_key"),
        ({"fair_key": 5}, "fair_key"),
        ({"fair_key": "a\x00b"}, "fair_key"),
    ]:
        with pytest.raises(InvalidTask, match=message):
            task(**options)(module_level)
