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

import inspect
import logging
import threading
from typing import Any, ClassVar, Protocol

from django.db import DatabaseError
from django.utils import timezone

from django_dbworker import errortext
from django_dbworker.handlers import WorkItemHandler, attempt_was_recorded
from django_dbworker.models import Status, WorkItem
from django_dbworker.registry import registry
from django_dbworker.tasks.compat import (
    InvalidTask,
    Task,
    TaskContext,
    TaskError,
    TaskResult,
    TaskResultStatus,
    normalize_json,
    task_finished,
    task_started,
)
from django_dbworker.tasks.results import Row, arguments, build, enqueued_task


class TaskOptions(Protocol):
    """A task's options after the backend's defaults (``backend.Options``)."""

    @property
    def max_attempts(self) -> int | None: ...
    @property
    def timeout(self) -> float | None: ...
    @property
    def atomic(self) -> bool: ...
    @property
    def sensitive(self) -> bool: ...


class OptionsSource(Protocol):
    """What ``handler_for`` needs of a backend (``DBWorkerBackend``).

    A protocol, not the class: the backend imports this module, and this
    module must not import it back (not even for type checking).
    """

    def resolved_options(self, task: Task) -> TaskOptions: ...


logger = logging.getLogger("django_dbworker.tasks")


class TaskHandler(WorkItemHandler):
    """Runs one Django task per claimed row; one subclass per task function.

    An attempt's ``TaskResult`` lives from ``attempt_started`` (which sends
    ``task_started``) to ``attempt_recorded`` (which sends ``task_finished``
    once the worker has written how the task ended), kept per attempt: row
    id and claim token.
    """

    abstract = True
    #: The task as ``@task`` declared it.
    task: ClassVar[Task]

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[tuple[int, Any], TaskResult] = {}

    def handle(self, payload: Any) -> Any:
        """Call the task function with the row's arguments (no context, no signals)."""
        args, kwargs = arguments(payload)
        if self.task.takes_context:
            raise TypeError(
                f"{self.name} takes a context: it runs through handle_item(), with its row."
            )
        return self.task.call(*args, **kwargs)

    def attempt_started(self, item: WorkItem) -> None:
        result = self._running_result(item)
        with self._lock:
            # Timed out and recorded while the row was read: attempt_recorded
            # found nothing to take, so a result kept now would stay forever;
            # and the attempt has ended, so it did not start as far as
            # receivers are concerned.
            if attempt_was_recorded(item):
                return
            self._running[(item.pk, item.claim_token)] = result
        _send(task_started, self._sender(), result)

    def _running_result(self, item: WorkItem) -> TaskResult:
        # First: it may read created_at, which _task_of needs.
        row = _running_row(item, takes_context=self.task.takes_context)
        return build(
            self._task_of(item), row, backend=self.task.backend, status=TaskResultStatus.RUNNING
        )

    def _task_of(self, item: WorkItem) -> Task:
        """The task as this row was enqueued (its priority, queue, run_after).

        The backend is the one the function was declared on: rows do not
        say which backend enqueued them.
        """
        try:
            return enqueued_task(
                self.task,
                backend=self.task.backend,
                priority=item.priority,
                queue=item.queue,
                run_after=item.run_after,
                created_at=item.__dict__.get("created_at"),
            )
        except InvalidTask:  # moved by an operator to a queue it may not use
            return self.task

    def handle_item(self, item: WorkItem) -> Any:
        """Call the task function, with its context if it takes one; return its value.

        The value goes through Django's ``normalize_json`` (tuples become
        lists); for a value it cannot normalize, its error is returned
        (``errortext.Unencodable``), and the worker records the task failed
        with Django's words ("Unsupported type: ..."), without a retry: it
        cannot store the value.
        """
        result, args = self._call_of(item)
        return _normalized(result, self.task.call(*args[0], **args[1]))

    def _call_of(self, item: WorkItem) -> tuple[TaskResult, tuple[tuple[Any, ...], dict[str, Any]]]:
        """The attempt's ``TaskResult`` and the arguments to call the function with."""
        with self._lock:
            result = self._running.get((item.pk, item.claim_token))
        if result is None:
            # Not started by the worker (a direct call), or its attempt was
            # recorded already (it timed out while task_started was being
            # sent): a result for the context only, kept nowhere.
            result = self._running_result(item)
        args, kwargs = arguments(item.payload)
        context: tuple[Any, ...] = (
            (TaskContext(task_result=result),) if self.task.takes_context else ()
        )
        return result, ((*context, *args), kwargs)

    def attempt_recorded(
        self, item: WorkItem, status: str | None, error: BaseException | None
    ) -> None:
        """Send ``task_finished`` if the attempt ended the task (SUCCESSFUL or FAILED).

        A retried or snoozed attempt has not finished the task; a fenced one
        is not this attempt's to report. One that ended ``cancelled`` (the
        task raised ``Cancelled``, or raised after a cancel request) finished
        it FAILED, as a cancelled row reads. Sent after the write committed, outside
        the task's transaction, so a receiver that reads the result sees it.
        """
        with self._lock:
            result = self._running.pop((item.pk, item.claim_token), None)
        if status not in (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED):
            return
        if result is None:
            # No result of this attempt here: a row stale recovery failed (its
            # worker died), or an attempt whose start failed. What the
            # database now says is the answer.
            row = WorkItem.objects.using(item._state.db).filter(pk=item.pk).first()
            if row is None:
                return
            result = build(self._task_of(row), Row.from_item(row), backend=self.task.backend)
        elif status == Status.SUCCEEDED:
            object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
            object.__setattr__(result, "finished_at", timezone.now())
        else:
            if error is not None:
                stored = errortext.format_error(error, sensitive=self.sensitive)
                result.errors.append(
                    TaskError(
                        exception_class_path=errortext.exception_class_path(error),
                        traceback=errortext.traceback_text(stored),
                    )
                )
            object.__setattr__(result, "status", TaskResultStatus.FAILED)
            object.__setattr__(result, "_return_value", None)
            object.__setattr__(result, "finished_at", timezone.now())
            if error is not None and not self.sensitive:
                # Inside an ``except``, as Django's ImmediateBackend sends it:
                # Django's own receiver logs the failure with sys.exc_info().
                # Not for a sensitive task: its messages may quote its arguments.
                _send_handling(error, self._sender(), result)
                return
        _send(task_finished, self._sender(), result)

    def _sender(self) -> type:
        """The backend class, the signals' sender (looked up once: per thread it is not cheap)."""
        sender = self.__dict__.get("_sender_class")
        if sender is None:
            sender = self.__dict__["_sender_class"] = type(self.task.get_backend())
        return sender


class AsyncTaskHandler(TaskHandler):
    """The handler of an ``async def`` task function: awaited on the worker's event loop
    (``worker/event_loop.py``), not run through ``async_to_sync`` on a thread."""

    abstract = True

    async def handle(self, payload: Any) -> Any:
        """Await the task function with the row's arguments (no context, no signals)."""
        args, kwargs = arguments(payload)
        if self.task.takes_context:
            raise TypeError(
                f"{self.name} takes a context: it runs through handle_item(), with its row."
            )
        return await self.task.acall(*args, **kwargs)

    async def handle_item(self, item: WorkItem) -> Any:
        """``TaskHandler.handle_item``, awaited."""
        result, args = self._call_of(item)
        return _normalized(result, await self.task.acall(*args[0], **args[1]))


def _normalized(result: TaskResult, value: Any) -> Any:
    """``value`` through Django's ``normalize_json``, kept as the result's return value; its
    error (``errortext.Unencodable``) if it has none."""
    try:
        value = normalize_json(value)
    except (TypeError, ValueError) as exc:
        return errortext.Unencodable(exc)
    object.__setattr__(result, "_return_value", value)
    return value


def _running_row(item: WorkItem, *, takes_context: bool) -> Row:
    """The claimed attempt as a result row, with what the claim did not return.

    The claim returns what every handler needs, not a task's history or its
    enqueue time; reading them is one query per attempt, which at short
    jobs' pace costs most of a task's run (measured: W1 fell to a tenth of
    a plain handler's). So they are read where they matter: for a retried
    row (``attempts`` > 1, so there is history) and for a task that takes a
    context (after an operator's Retry a first attempt may have history,
    and the context must agree with get_result). Otherwise the result
    given to ``task_started`` and ``task_finished`` has no ``enqueued_at``
    and starts now, by this host's clock; ``get_result`` has every field.
    A read that fails costs the task nothing: the result goes without them.
    """
    extra: tuple[Any, ...] | None = None
    if item.attempts > 1 or takes_context:
        try:
            extra = (
                WorkItem.objects.using(item._state.db)
                .filter(pk=item.pk)
                .values_list("error_history", "created_at", "claimed_at")
                .first()
            )
        except DatabaseError as exc:
            logger.warning(
                "Could not read the history of task row %s: %s",
                item.pk,
                errortext.error_summary(exc),
            )
    history, created_at, claimed_at = extra or (None, None, timezone.now())
    if created_at is not None:
        item.__dict__.setdefault("created_at", created_at)
    return Row(
        id=item.pk,
        status=Status.CLAIMED,
        payload=item.payload,
        attempts=item.attempts,
        created_at=created_at,
        claimed_at=claimed_at,
        claimed_by=item.claimed_by,
        error_history=history,
    )


def _send(signal: Any, sender: type, result: TaskResult) -> None:
    """Send robustly: a receiver that raises is logged, never changes the outcome."""
    for receiver, response in signal.send_robust(sender=sender, task_result=result):
        if isinstance(response, Exception):
            logger.error(
                "A receiver of %s (%r) raised for task result %s: %s",
                "task_started" if signal is task_started else "task_finished",
                receiver,
                result.id,
                type(response).__name__,
            )


def _send_handling(error: BaseException, sender: type, result: TaskResult) -> None:
    """``task_finished`` sent while ``error`` is being handled (``sys.exc_info()`` is it).

    Raising the exception again adds this frame to its traceback and may set
    its context; both are put back, so what was recorded stays what it was.
    """
    traceback, context = error.__traceback__, error.__context__
    try:
        raise error
    except BaseException:
        _send(task_finished, sender, result)
    finally:
        error.__traceback__, error.__context__ = traceback, context


def handler_for(task: Task, backend: OptionsSource) -> type[TaskHandler]:
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
    base = AsyncTaskHandler if inspect.iscoroutinefunction(task.func) else TaskHandler
    cls = type(
        f"{task.func.__name__}_handler",
        (base,),
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
