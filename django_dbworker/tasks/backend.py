"""``DBWorkerBackend``: Django's Tasks framework on django-dbworker's engine.

``TASKS = {"default": {"BACKEND": "django_dbworker.tasks.DBWorkerBackend"}}``
makes every ``@task`` function enqueue one ``WorkItem`` (in the caller's
transaction, like ``enqueue()``), which ``run_workers`` runs with all the
worker's guarantees: SKIP LOCKED claims, heartbeats, fencing, retries with
backoff, timeouts and recovery of tasks whose worker died.

Beyond Django's API, a task can say how it is run: ``max_attempts``,
``timeout``, ``atomic``, ``sensitive``, ``unique_key`` and ``fair_key``. They are fields
of ``DBWorkerTask`` (this backend's ``task_class``), given to
``django_dbworker.tasks.task`` (or to the backport's ``@task``, which passes
extra options on), with defaults from the backend's ``OPTIONS``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.apps import apps
from django.core.checks import CheckMessage, Error
from django.core.exceptions import ImproperlyConfigured

from django_dbworker import validation
from django_dbworker.conf import dbworker_settings
from django_dbworker.discovery import import_by_path
from django_dbworker.enqueue_options import EnqueueOptions
from django_dbworker.enqueuing import insert_one
from django_dbworker.models import WorkItem
from django_dbworker.registry import registry
from django_dbworker.routing import work_db_for_read
from django_dbworker.tasks.compat import (
    DEFAULT_TASK_BACKEND_ALIAS,
    DEFAULT_TASK_PRIORITY,
    DEFAULT_TASK_QUEUE_NAME,
    BaseTaskBackend,
    InvalidTask,
    Task,
    TaskResult,
    TaskResultDoesNotExist,
    normalize_json,
    task_backends,
    task_enqueued,
)
from django_dbworker.tasks.handler import TaskHandler, handler_for
from django_dbworker.tasks.results import RESULT_COLUMNS, Row, build, enqueued_task

#: The handler column's width: a task's import path must fit.
MAX_NAME = 200
#: unique_key column width.
MAX_UNIQUE_KEY = 255

UniqueKey = str | Callable[..., "str | None"] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class DBWorkerTask(Task):
    """A Django ``Task`` with django-dbworker's options (None: the backend's default)."""

    #: Runs before the task ends FAILED (OPTIONS ``MAX_ATTEMPTS``, then DBWORKER's).
    max_attempts: int | None = None
    #: Seconds before a run is abandoned and counted as a failed attempt.
    timeout: float | None = None
    #: Run the function and the success record in one transaction.
    atomic: bool | None = None
    #: Keep the arguments and error messages out of the admin, logs and spans.
    sensitive: bool | None = None
    #: At most one live (READY or RUNNING) result per key: a string, or a
    #: callable given the task's arguments that returns one (or None).
    unique_key: UniqueKey = None
    #: Its items' fair key (claims take turns across the keys with ready work): a string,
    #: or a callable given the task's arguments that returns one (or None).
    fair_key: UniqueKey = None


@dataclass(frozen=True)
class Options:
    """A task's options after the backend's defaults were applied."""

    max_attempts: int | None
    timeout: float | None
    atomic: bool
    sensitive: bool


def task(
    function: Callable[..., Any] | None = None,
    *,
    priority: int = DEFAULT_TASK_PRIORITY,
    queue_name: str = DEFAULT_TASK_QUEUE_NAME,
    backend: str = DEFAULT_TASK_BACKEND_ALIAS,
    takes_context: bool = False,
    max_attempts: int | None = None,
    timeout: float | None = None,
    atomic: bool | None = None,
    sensitive: bool | None = None,
    unique_key: UniqueKey = None,
    fair_key: UniqueKey = None,
) -> Any:
    """Django's ``@task`` with django-dbworker's options, on any Django version.

    ``@task(max_attempts=5, timeout=30)`` declares the same ``Task`` as
    ``django.tasks.task`` would, for a backend that is a ``DBWorkerBackend``.
    """

    def wrapper(func: Callable[..., Any]) -> Any:
        task_class = task_backends[backend].task_class
        if not (isinstance(task_class, type) and issubclass(task_class, DBWorkerTask)):
            raise InvalidTask(
                f"Task backend {backend!r} is not a DBWorkerBackend: django_dbworker.tasks.task "
                "options need one (use django.tasks.task for other backends)."
            )
        return task_class(
            priority=priority,
            func=func,
            queue_name=queue_name,
            backend=backend,
            takes_context=takes_context,
            run_after=None,
            max_attempts=max_attempts,
            timeout=timeout,
            atomic=atomic,
            sensitive=sensitive,
            unique_key=unique_key,
            fair_key=fair_key,
        )

    return wrapper(function) if function is not None else wrapper


class DBWorkerBackend(BaseTaskBackend):
    """Tasks stored as ``WorkItem`` rows and run by ``manage.py run_workers``."""

    task_class = DBWorkerTask
    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True
    #: How ``discovery.autodiscover`` tells that ``tasks`` modules hold our handlers.
    is_dbworker_backend = True

    # -- declaring ----------------------------------------------------------------

    def validate_task(self, task: Task) -> None:
        """Django's checks, then ours: the name, the queue, the options; registers the handler."""
        super().validate_task(task)
        name = task.module_path
        if len(name) > MAX_NAME:
            raise InvalidTask(f"Task import path {name!r} is longer than {MAX_NAME} characters.")
        try:
            validation.queue_name(task.queue_name)
        except validation.InvalidValue as exc:
            raise InvalidTask(f"queue_name {exc}.") from None
        for field, validator in validation.TASK_OPTIONS.items():
            try:
                validator(getattr(task, field.lower(), None))
            except validation.InvalidValue as exc:
                raise InvalidTask(f"{field.lower()} {exc}.") from None
        key = getattr(task, "unique_key", None)
        if key is not None and not callable(key):
            _check_unique_key(key, InvalidTask)
        fair_key = getattr(task, "fair_key", None)
        if not callable(fair_key):  # a callable's keys are checked by each enqueue
            try:
                validation.fair_key(fair_key)
            except validation.InvalidValue as exc:
                raise InvalidTask(f"fair_key {exc}.") from None
        options = self.resolved_options(task)
        if options.atomic and inspect.iscoroutinefunction(task.func):
            raise InvalidTask(
                "An atomic task must be a plain function: an async one runs its queries "
                "outside the transaction that records its success."
            )
        handler = handler_for(task, self)
        # One function, one way of running it: a backend whose defaults would
        # run it differently than its handler does must not take it.
        runs = (handler.timeout, handler.atomic, handler.sensitive)
        wanted = (options.timeout, options.atomic, options.sensitive)
        if runs != wanted:
            raise InvalidTask(
                f"Task {name} runs with timeout={runs[0]!r}, atomic={runs[1]!r}, "
                f"sensitive={runs[2]!r} (from the backend it was declared on); backend "
                f"{self.alias!r} would run it with timeout={wanted[0]!r}, atomic={wanted[1]!r}, "
                f"sensitive={wanted[2]!r}. Set these options on the task itself."
            )

    def resolved_options(self, task: Task) -> Options:
        """The task's own options, else this backend's OPTIONS, else DBWORKER's."""
        defaults = self._defaults()

        def pick(field: str) -> Any:
            own = getattr(task, field, None)
            return defaults.get(field.upper()) if own is None else own

        return Options(
            max_attempts=pick("max_attempts"),
            timeout=pick("timeout"),
            atomic=bool(pick("atomic")),
            sensitive=bool(pick("sensitive")),
        )

    def _defaults(self) -> dict[str, Any]:
        """``OPTIONS``, validated once: every enqueue asks for them.

        A backend is rebuilt when ``TASKS`` changes (Django's
        ``setting_changed`` receiver), so they cannot go stale.
        """
        defaults: dict[str, Any] | None = self.__dict__.get("_checked_options")
        if defaults is None:
            problems = options_problems(self.options)
            if problems:
                raise ImproperlyConfigured(f"TASKS[{self.alias!r}]: {problems[0]}")
            defaults = self.__dict__["_checked_options"] = dict(self.options or {})
        return defaults

    # -- enqueueing ---------------------------------------------------------------

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        """One ``WorkItem`` for this call, in the caller's transaction; its result READY.

        Arguments go through Django's ``normalize_json`` first, so a value
        JSON cannot hold raises Django's own error before anything is
        written. With a ``unique_key`` whose result is still live, that
        result is returned and nothing is added.
        """
        self.validate_task(task)
        payload = {"args": normalize_json(list(args)), "kwargs": normalize_json(dict(kwargs))}
        handler = handler_for(task, self)
        max_attempts = self.resolved_options(task).max_attempts
        options = EnqueueOptions(
            run_after=task.run_after,
            # Django's validate_task takes any whole number (5.0, True).
            priority=int(task.priority),
            queue=task.queue_name,
            unique_key=_unique_key(task, args, kwargs),
            fair_key=_fair_key(task, args, kwargs),
            max_attempts=int(
                dbworker_settings.MAX_ATTEMPTS if max_attempts is None else max_attempts
            ),
        )
        item, added = insert_one(handler, payload, options)
        result = build(task, Row.from_item(item), backend=self.alias)
        if added:  # not for the live row of a unique_key: that was enqueued before
            task_enqueued.send(type(self), task_result=result)
        return result

    # -- results ------------------------------------------------------------------

    def get_result(self, result_id: str) -> TaskResult:
        """The result of the task row ``result_id``; ``TaskResultDoesNotExist`` if none."""
        pk = _row_id(result_id)
        values = (
            WorkItem.objects.using(work_db_for_read()).filter(pk=pk).values(*RESULT_COLUMNS).first()
            if pk is not None
            else None
        )
        if values is None:
            raise TaskResultDoesNotExist(result_id)
        task = task_of(str(values["handler"]))
        if task is None:
            raise TaskResultDoesNotExist(
                f"{result_id} is a work item of handler {values['handler']!r}, not a task."
            )
        try:
            as_enqueued = enqueued_task(
                task,
                backend=self.alias,
                priority=values["priority"],
                queue=values["queue"],
                run_after=values["run_after"],
                created_at=values["created_at"],
            )
        except InvalidTask:
            # Moved (by an operator) to a queue the task may not use: as declared.
            try:
                as_enqueued = task if task.backend == self.alias else task.using(backend=self.alias)
            except InvalidTask:
                raise TaskResultDoesNotExist(
                    f"{result_id} is a task that backend {self.alias!r} cannot run."
                ) from None
        return build(as_enqueued, Row.from_values(values), backend=self.alias)

    # -- checks -------------------------------------------------------------------

    def check(self, **kwargs: Any) -> list[CheckMessage]:
        messages: list[CheckMessage] = list(super().check(**kwargs))
        where = f"TASKS[{self.alias!r}]"
        if not apps.is_installed("django_dbworker"):
            messages.append(
                Error(
                    f"{where} uses DBWorkerBackend but django_dbworker is not in INSTALLED_APPS.",
                    hint="Add 'django_dbworker' to INSTALLED_APPS and run migrate.",
                    id="django_dbworker.E015",
                )
            )
        for problem in options_problems(self.options):
            messages.append(
                Error(
                    f"{where}: {problem}",
                    hint="OPTIONS takes MAX_ATTEMPTS, TIMEOUT, ATOMIC and SENSITIVE.",
                    id="django_dbworker.E016",
                )
            )
        for queue in sorted(map(str, self.queues)):
            try:
                validation.queue_name(queue)
            except validation.InvalidValue as exc:
                messages.append(
                    Error(
                        f"{where}: QUEUES entry {exc}.",
                        hint="Queue names are 1 to 100 characters of [A-Za-z0-9_.:-].",
                        id="django_dbworker.E017",
                    )
                )
        return messages


def options_problems(options: Any) -> list[str]:
    """What is wrong with a backend's ``OPTIONS``, one sentence per problem."""
    if options is None:
        return []
    if not isinstance(options, dict):
        return [f"OPTIONS must be a dict, got {type(options).__name__}."]
    problems = []
    for key, value in options.items():
        validator = validation.TASK_OPTIONS.get(key)
        if validator is None:
            known = ", ".join(validation.TASK_OPTIONS)
            problems.append(f"unknown OPTIONS key {key!r} (known: {known}).")
            continue
        try:
            validator(value)
        except validation.InvalidValue as exc:
            problems.append(f"OPTIONS[{key!r}] {exc}.")
    return problems


def task_of(name: str) -> Task | None:
    """The task whose handler is named ``name``, importing its module if needed.

    ``name`` comes from a row, which anyone who can write to the table
    controls: its module is imported only as the worker would import it
    (``import_by_path``: a module of the project's own packages), never
    whatever module a row names.
    """
    cls = registry.get(name)
    if cls is None:
        import_by_path([name])
        cls = registry.get(name)
    if isinstance(cls, type) and issubclass(cls, TaskHandler):
        return cls.task
    return None


def _row_id(result_id: Any) -> int | None:
    """The row id a result id stands for, only if this backend could have issued it.

    ASCII digits without a leading zero: ``isdigit()`` alone accepts "²"
    (which ``int()`` refuses) and other scripts' digits, and "01" would read
    as row 1 under another id.
    """
    text = result_id if isinstance(result_id, str) else str(result_id)
    if not (text.isascii() and text.isdigit()) or len(text) > 19 or str(int(text)) != text:
        return None
    return int(text)


def _unique_key(task: Task, args: Any, kwargs: Any) -> str | None:
    key = getattr(task, "unique_key", None)
    if callable(key):
        key = key(*args, **kwargs)
        if key is not None:
            _check_unique_key(key, TypeError)
    return key


def _fair_key(task: Task, args: Any, kwargs: Any) -> str | None:
    """The task's ``fair_key`` for these arguments (checked by the enqueue)."""
    key = getattr(task, "fair_key", None)
    return key(*args, **kwargs) if callable(key) else key


def _check_unique_key(key: Any, error: type[Exception]) -> None:
    if not isinstance(key, str) or not key or len(key) > MAX_UNIQUE_KEY:
        raise error(
            f"unique_key must be a non-empty string of at most {MAX_UNIQUE_KEY} characters "
            f"(or a callable returning one, or None), got {key!r}."
        )
