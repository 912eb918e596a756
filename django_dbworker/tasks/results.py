"""A ``WorkItem`` row read as Django's ``TaskResult``.

The row is the result: no second table. Statuses map as pending -> READY
(also between retries), claimed -> RUNNING, succeeded -> SUCCESSFUL,
failed and cancelled -> FAILED (a cancelled row gets an error that says
so, unless the attempt that ended it has its own). ``errors`` and
``worker_ids`` come from ``error_history``, one entry per attempt that
ended without success, plus the worker of the current or successful
attempt (``claimed_by``); so ``attempts`` counts every run, including one
lost with its worker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.utils import timezone
from django.utils.dateparse import parse_datetime

from django_dbworker import errortext
from django_dbworker.models import Status, WorkItem
from django_dbworker.tasks.compat import Task, TaskError, TaskResult, TaskResultStatus

#: The class path of the error a cancelled row gets when no attempt of its own says
#: so (cancelled while pending, or released by a stopping worker). An attempt that
#: ended ``cancelled`` keeps the class of what it raised (``Cancelled``, or another
#: exception raised after a request; a lost worker's), as ``error_history`` holds it.
CANCELLED = "django_dbworker.errors.Cancelled"
#: Stands in ``worker_ids`` for attempts older than the kept history.
NOT_KEPT = "(not kept)"

STATUSES = {
    Status.PENDING: TaskResultStatus.READY,
    Status.CLAIMED: TaskResultStatus.RUNNING,
    Status.SUCCEEDED: TaskResultStatus.SUCCESSFUL,
    Status.FAILED: TaskResultStatus.FAILED,
    Status.CANCELLED: TaskResultStatus.FAILED,
}

#: The columns ``get_result`` reads.
RESULT_COLUMNS = (
    "id",
    "handler",
    "queue",
    "priority",
    "payload",
    "status",
    "attempts",
    "created_at",
    "run_after",
    "claimed_at",
    "claimed_by",
    "finished_at",
    "result",
    "error_history",
)


@dataclass(frozen=True)
class Row:
    """What a task result is made of, whether read by ``get_result`` or claimed."""

    id: int
    status: str
    payload: Any
    attempts: int
    created_at: datetime | None
    claimed_at: datetime | None
    claimed_by: str
    finished_at: datetime | None = None
    result: Any = None
    error_history: Any = None

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> Row:
        return cls(**{name: values[name] for name in cls.__dataclass_fields__})

    @classmethod
    def from_item(cls, item: WorkItem) -> Row:
        """A row loaded in full (or just inserted by enqueue)."""
        return cls(**{name: getattr(item, name) for name in cls.__dataclass_fields__})


def arguments(payload: Any) -> tuple[list[Any], dict[str, Any]]:
    """The task's ``args`` and ``kwargs`` from a row's payload (``{"args", "kwargs"}``)."""
    if not isinstance(payload, Mapping):
        return [], {}
    args = payload.get("args") or []
    kwargs = payload.get("kwargs") or {}
    if not isinstance(args, list):
        args = []
    return list(args), kwargs if isinstance(kwargs, dict) else {}


def history_entries(history: Any) -> list[Mapping[str, Any]]:
    """The well-formed entries of an ``error_history`` value (a JSON array)."""
    if not isinstance(history, Sequence) or isinstance(history, str):
        return []
    return [entry for entry in history if isinstance(entry, Mapping)]


def entry_time(value: Any) -> datetime | None:
    """A timestamp as JSON holds it (ISO text; SQLite's has a space and no zone)."""
    if not isinstance(value, str):
        return None
    try:
        parsed = parse_datetime(value.replace(" ", "T", 1))
    except ValueError:
        return None
    if parsed is not None and timezone.is_naive(parsed):
        parsed = parsed.replace(tzinfo=UTC)
    return parsed


def enqueued_task(
    task: Task,
    *,
    backend: str,
    priority: int,
    queue: str,
    run_after: datetime | None,
    created_at: datetime | None,
) -> Task:
    """``task`` as a row holds it: on ``backend``, with the row's priority, queue and
    ``run_after`` (if it was deferred), as Django's database backend answers.

    ``InvalidTask`` if ``backend`` may not run it (another backend's
    options, a queue it does not allow).
    """
    changes: dict[str, Any] = {}
    if task.backend != backend:
        changes["backend"] = backend
    if task.priority != priority:
        changes["priority"] = priority
    if task.queue_name != queue:
        changes["queue_name"] = queue
    if run_after is not None and created_at is not None and run_after > created_at:
        changes["run_after"] = run_after
    return task.using(**changes) if changes else task


def _ended_by_its_attempt(row: Row, entries: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the row's last history entry is the attempt that ended it (one error each).

    An attempt that ends ``cancelled`` (it raised after a request, or raised
    ``Cancelled``; its worker was lost after one) is written to the history
    by the UPDATE that sets ``finished_at``, from the same database clock
    reading; a row cancelled while pending, or released by a stopping
    worker, has no entry of its own and gets the ``CANCELLED`` marker.
    """
    if not entries or row.finished_at is None:
        return False
    return entry_time(entries[-1].get("finished_at")) == row.finished_at


def build(task: Task, row: Row, *, backend: str, status: Any = None) -> TaskResult:
    """The ``TaskResult`` of ``row`` for ``task`` (``status`` overrides the row's)."""
    entries = history_entries(row.error_history)
    errors = [
        TaskError(
            exception_class_path=str(entry.get("exception_class_path") or "builtins.Exception"),
            traceback=errortext.traceback_text(str(entry.get("error") or "")),
        )
        for entry in entries
    ]
    worker_ids = [str(entry.get("worker") or "") for entry in entries]
    current = row.status in (Status.CLAIMED, Status.SUCCEEDED)
    if current:
        worker_ids.append(row.claimed_by)
    if len(worker_ids) < row.attempts:
        # Older attempts than the history keeps (or a row retried by an
        # operator, which restarts ``attempts``): the count stays right.
        worker_ids[:0] = [NOT_KEPT] * (row.attempts - len(worker_ids))
    if row.status == Status.CANCELLED and not _ended_by_its_attempt(row, entries):
        errors.append(TaskError(exception_class_path=CANCELLED, traceback="Cancelled."))
    started = entry_time(entries[0].get("started_at")) if entries else None
    args, kwargs = arguments(row.payload)
    result: TaskResult = TaskResult(
        task=task,
        id=str(row.id),
        status=status or STATUSES.get(Status(row.status), TaskResultStatus.FAILED),
        enqueued_at=row.created_at,
        started_at=started or row.claimed_at,
        finished_at=row.finished_at,
        last_attempted_at=row.claimed_at,
        args=args,
        kwargs=kwargs,
        backend=backend,
        errors=errors,
        worker_ids=worker_ids,
    )
    if row.status == Status.SUCCEEDED:
        object.__setattr__(result, "_return_value", row.result)
    return result
