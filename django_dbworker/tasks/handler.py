"""A ``@task`` function as a ``WorkItemHandler``: how the worker runs Django tasks.

Each task function gets a handler class, registered under the function's
import path (``Task.module_path``), so ``run_workers`` claims, heartbeats,
fences, retries and recovers task rows exactly like any other handler's,
side by side, and the admin, the metrics (``worker`` label = the import
path) and the traces show them the same way. The handler adds what Django's
API promises a task: the ``args``/``kwargs`` call, a ``TaskContext`` with
the right attempt, and the ``task_started``/``task_finished`` signals in
the worker process.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

from django.utils import timezone

from django_dbworker import transitions
from django_dbworker.handlers import WorkItemHandler
from django_dbworker.models import WorkItem
from django_dbworker.registry import registry
from django_dbworker.tasks.compat import (
    Task,
    TaskContext,
    TaskError,
    TaskResult,
    TaskResultStatus,
    normalize_json,
    task_finished,
    task_started,
)
from django_dbworker.tasks.results import Row, arguments, build

if TYPE_CHECKING:
    from django_dbworker.tasks.backend import DBWorkerBackend

logger = logging.getLogger("django_dbworker.tasks")


class TaskHandler(WorkItemHandler):
    """Runs one Django task per claimed row; one subclass per task function."""

    abstract = True
    #: The task as ``@task`` declared it.
    task: ClassVar[Task]

    def handle(self, payload: Any) -> Any:
        """Call the task function with the row's arguments (no context, no signals)."""
        args, kwargs = arguments(payload)
        if self.task.takes_context:
            raise TypeError(
                f"{self.name} takes a context: it runs through handle_item(), with its row."
            )
        return self.task.call(*args, **kwargs)

    def handle_item(self, item: WorkItem) -> Any:
        """Run the task for one attempt, as Django's backends do, with our recording.

        Signals are sent robustly: a receiver that raises is logged and
        never changes the attempt's outcome (a failing ``task_finished``
        receiver must not turn a success into a retry that runs the task
        again).
        """
        task = self.task
        sender = type(task.get_backend())
        args, kwargs = arguments(item.payload)
        result = build(
            task,
            _running_row(item),
            backend=task.backend,
            status=TaskResultStatus.RUNNING,
        )
        _send(task_started, sender, result)
        failure: BaseException | None = None
        try:
            if task.takes_context:
                value = task.call(TaskContext(task_result=result), *args, **kwargs)
            else:
                value = task.call(*args, **kwargs)
        except BaseException as exc:
            if not self._is_last(exc, item):
                raise  # retried: the task has not finished
            _finish_failed(result, exc, sensitive=self.sensitive)
            if not self.sensitive:
                # Inside the except block, as Django's backends do: its log
                # receiver prints the traceback.
                _send(task_finished, sender, result)
                raise
            failure = exc
        if failure is not None:
            # Outside it for sensitive tasks, whose messages may quote their
            # arguments: receivers see no exception to log.
            _send(task_finished, sender, result)
            raise failure
        try:
            normalized = _normalize(value)
        except (TypeError, ValueError) as exc:
            # Recorded as failed by the worker (a result it cannot store is
            # not retried): say so to the receivers too.
            _finish_failed(result, exc, sensitive=self.sensitive)
            _send(task_finished, sender, result)
            return value
        object.__setattr__(result, "_return_value", normalized)
        object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
        object.__setattr__(result, "finished_at", timezone.now())
        _send(task_finished, sender, result)
        return normalized

    def _is_last(self, exc: BaseException, item: WorkItem) -> bool:
        """Whether this failure ends the task (the worker will not retry it)."""
        return not isinstance(exc, self.retry_on) or item.attempts >= item.max_attempts


def _running_row(item: WorkItem) -> Row:
    """The claimed attempt as a result row; earlier attempts' history is read only if any."""
    history: Any = None
    if item.attempts > 1:
        history = (
            WorkItem.objects.using(item._state.db)
            .filter(pk=item.pk)
            .values_list("error_history", flat=True)
            .first()
        )
    values = item.__dict__
    return Row(
        id=item.pk,
        status="claimed",
        payload=item.payload,
        attempts=item.attempts,
        created_at=values.get("created_at"),
        claimed_at=values.get("claimed_at"),
        claimed_by=item.claimed_by,
        error_history=history,
    )


def _normalize(value: Any) -> Any:
    return normalize_json(value)


def _finish_failed(result: TaskResult, exc: BaseException, *, sensitive: bool = False) -> None:
    """Mark ``result`` failed by ``exc``, with the error as the history will keep it."""
    result.errors.append(
        TaskError(
            exception_class_path=transitions.exception_class_path(exc),
            traceback=transitions.format_error(exc, sensitive=sensitive),
        )
    )
    object.__setattr__(result, "status", TaskResultStatus.FAILED)
    object.__setattr__(result, "finished_at", timezone.now())


def _send(signal: Any, sender: type, result: TaskResult) -> None:
    for receiver, response in signal.send_robust(sender=sender, task_result=result):
        if isinstance(response, BaseException):
            logger.error(
                "A receiver of %s (%r) raised for task result %s: %s",
                "task_started" if signal is task_started else "task_finished",
                receiver,
                result.id,
                type(response).__name__,
            )


def handler_for(task: Task, backend: DBWorkerBackend) -> type[TaskHandler]:
    """The handler class of ``task``'s function, registering it the first time.

    Keyed by the function, not the ``Task`` object: ``task.using(...)``
    variants share their function's handler, whose options (timeout,
    atomic, sensitive, max_attempts) are the function's.
    """
    name = task.module_path
    existing = registry.get(name)
    if (
        isinstance(existing, type)
        and issubclass(existing, TaskHandler)
        and existing.task.func is task.func
    ):
        return existing
    options = backend.resolved_options(task)
    cls = type(
        f"{task.func.__name__}_handler",
        (TaskHandler,),
        {
            "__module__": task.func.__module__,
            "__qualname__": f"{task.func.__qualname__}.handler",
            "__doc__": f"Runs the Django task {name}.",
            "name": name,
            "task": task,
            "queue": task.queue_name,
            "max_attempts": options.max_attempts,
            "timeout": options.timeout,
            "atomic": bool(options.atomic),
            "sensitive": bool(options.sensitive),
        },
    )
    return cls
