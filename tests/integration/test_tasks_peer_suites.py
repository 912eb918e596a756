"""Where the Django Tasks peers' own suites found ``DBWorkerBackend`` differing.

Django 6's ``tests/tasks`` (``test_immediate_backend.py``: ``test_catches_exception``,
``test_complex_return_value``) and django-tasks-db's suite expect a failed
task's ``errors[i].traceback`` to be what ``traceback.format_exception``
gives, Django's ``task_finished`` log line to carry the exception, and a
return value JSON cannot hold to fail with Django's own ``normalize_json``
error ("Unsupported type"). On Django 5.2 (the backport) and Django 6.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from django_dbworker.tasks.compat import TaskResultStatus, task_finished
from django_dbworker.testing import run_until_empty
from tests.testapp import tasks

pytestmark = pytest.mark.django_db

TRACEBACK = "Traceback (most recent call last):\n"


@pytest.fixture
def finished() -> Any:
    """The results ``task_finished`` was sent with, and the exception being handled then."""
    import sys

    sent: list[tuple[Any, BaseException | None]] = []

    def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
        sent.append((task_result, sys.exc_info()[1]))

    task_finished.connect(receiver)
    yield sent
    task_finished.disconnect(receiver)


def test_a_failed_tasks_traceback_is_the_python_traceback(finished: Any) -> None:
    result = tasks.always_fails.enqueue("k")
    run_until_empty(include_scheduled=True)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and len(result.errors) == 2
    for error in result.errors:
        assert error.exception_class is ValueError
        assert error.traceback.startswith(TRACEBACK), error.traceback
        assert error.traceback.endswith("ValueError: always fails: k\n"), error.traceback
        assert 'tests/testapp/tasks.py", line' in error.traceback
    # The result task_finished carries says the same.
    ((live, _),) = finished
    assert live.errors[-1].traceback.startswith(TRACEBACK)
    assert live.errors[-1].traceback.endswith("ValueError: always fails: k\n")


def test_djangos_failure_log_line_carries_the_exception(
    finished: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    result = tasks.always_fails.enqueue("k")
    run_until_empty(include_scheduled=True)
    ((live, handled),) = finished
    assert live.id == result.id and live.status == TaskResultStatus.FAILED
    # task_finished is sent while the task's exception is being handled, as
    # Django's ImmediateBackend sends it: receivers that log exc_info see it.
    assert isinstance(handled, ValueError) and str(handled) == "always fails: k"
    (line,) = [
        r for r in caplog.records if r.name.startswith("django") and "state=FAILED" in r.message
    ]
    assert line.levelno == logging.ERROR
    assert line.exc_info is not None and line.exc_info[1] is handled
    assert "always fails: k" in caplog.text.split("state=FAILED", 1)[1]


def test_a_sensitive_tasks_exception_is_not_handed_to_the_log(finished: Any) -> None:
    # Its message may quote its arguments: the log line goes without it.
    tasks.secret.enqueue("hunter2")
    run_until_empty(include_scheduled=True)
    ((live, handled),) = finished
    assert live.status == TaskResultStatus.FAILED and handled is None
    assert live.errors[-1].traceback.startswith(TRACEBACK)
    assert "hunter2" not in live.errors[-1].traceback


def test_a_return_value_json_cannot_hold_fails_with_djangos_error(finished: Any) -> None:
    result = tasks.not_json.enqueue()
    run_until_empty()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and result.attempts == 1
    (error,) = result.errors
    assert error.exception_class is TypeError
    assert "Unsupported type: <class 'object'>" in error.traceback, error.traceback
    assert "JSON-serialisable" not in error.traceback
    ((live, handled),) = finished
    assert live.errors[-1].exception_class is TypeError
    assert "Unsupported type: <class 'object'>" in live.errors[-1].traceback
    assert isinstance(handled, TypeError)
