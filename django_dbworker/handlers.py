"""Handler base classes: the generic claim/process kit and the WorkItem handler.

A handler class is declared once and registers itself under ``name``. The
worker runtime creates one instance per class and process; handlers should
keep no per-item state on ``self`` since several threads call them at once.

A declaration: imports settings, the registry, the backoff maths and the
enqueue options, never enqueuing, the worker, the admin or commands (import
contracts in pyproject.toml).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from django.core.exceptions import ImproperlyConfigured

from django_dbworker.backoff import exponential_backoff
from django_dbworker.conf import dbworker_settings
from django_dbworker.enqueue_options import EnqueueOptions
from django_dbworker.registry import registry

if TYPE_CHECKING:
    from django_dbworker.models import WorkItem

T = TypeVar("T")


class Handler(Generic[T]):
    """Claim one item, process it; optionally recover stale items (make them ready again).

    Concrete subclasses register themselves under ``name`` when their class is
    created. Set ``abstract = True`` on a base class to keep it out of the
    registry.
    """

    abstract: ClassVar[bool] = True
    name: ClassVar[str] = ""
    #: Seconds between polling cycles when ``claim`` raised ``NoTask``.
    interval: ClassVar[float] = 10.0
    #: Items processed at once by this handler in one process.
    max_concurrency: ClassVar[int] = 5

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Only the class's own attribute counts: subclasses of an abstract base
        # are concrete unless they say otherwise.
        if cls.__dict__.get("abstract", False):
            return
        registry.register(cls)

    def claim(self) -> T:
        """Claim and return one item, or raise ``NoTask``. Subclasses must implement it."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement claim()")

    def process(self, item: T) -> None:
        """Do the work for one claimed item. Handles its own failures."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement process()")

    def recover_stale(self) -> None:
        """Recover items abandoned by crashed workers; called at each cycle start."""

    def __repr__(self) -> str:
        return f"<{type(self).__qualname__} {self.name!r}>"


class WorkItemHandler(Handler["WorkItem"]):
    """A handler for jobs stored in the built-in ``WorkItem`` table.

    Subclasses implement ``handle(payload)``. Claiming, heartbeats, outcome
    recording, retries and stale recovery are provided by the worker: all
    WorkItem handlers of a ``run_workers`` process share one claim loop, so
    a WorkItemHandler is a ``Handler[WorkItem]`` by its declaration (name,
    registration) but has no ``claim``/``process`` of its own.
    """

    abstract = True
    #: Queue used by ``enqueue`` when none is given.
    queue: ClassVar[str] = "default"
    #: Attempts before the item ends ``failed``; None means DBWORKER["MAX_ATTEMPTS"].
    max_attempts: ClassVar[int | None] = None
    #: Seconds before a running ``handle`` is abandoned; None means no limit.
    timeout: ClassVar[float | None] = None
    #: Run ``handle`` and the success record in one fenced transaction.
    atomic: ClassVar[bool] = False
    #: Keep the payload out of the admin, logs and spans.
    sensitive: ClassVar[bool] = False
    #: Exceptions that schedule a retry; any other one fails the item at once.
    retry_on: ClassVar[tuple[type[BaseException], ...]] = (Exception,)
    #: At most N starts in any window of one period, cluster-wide: "N/s",
    #: "N/m" or "N/h" (None: no limit). Items beyond it wait pending; waiting
    #: is not an attempt (``flow/rates.py``: each start is taken as the handler starts).
    rate_limit: ClassVar[str | None] = None
    #: At most this many items of one ``concurrency_key`` claimed at once,
    #: across all workers (items enqueued without a key are not limited);
    #: None: no limit. The current value decides (a deploy that changes it
    #: applies to rows already enqueued); each keyed row records it at enqueue.
    concurrency_limit: ClassVar[int | None] = None
    #: The fair key of its items when the enqueue gives none (``flow/fair.py``): claims
    #: take turns across the keys with ready work. None: no key.
    fair_key: ClassVar[str | None] = None

    @property
    def cancel_requested(self) -> bool:
        """Whether an operator asked to stop the attempt this thread is running.

        ``item.cancel()`` (or the admin's Cancel) on a running item sets it
        within about one heartbeat interval, for that attempt only: the
        worker runs one instance of a handler class for all its threads, so
        this reads the attempt of the calling thread, never another's (an
        abandoned, timed-out run keeps its own). Check it in ``handle``'s
        own thread, in loops and between steps; then raise
        (``django_dbworker.Cancelled`` or any exception) to end the item
        ``cancelled``, not retried, or return to end it ``succeeded``
        anyway. On any other thread (a thread pool, a library's callbacks,
        ``async_to_sync``) it is always False: give long calls
        ``self.cancel_check`` instead. In an ``async def handle`` it reads
        the attempt of the running coroutine (and of what it awaits); the
        worker also cancels the coroutine itself at a request. Always False
        outside a worker's attempt (``handle`` called directly, an
        own-table handler).
        """
        item = _current_item()
        return item is not None and cancel_was_requested(item)

    @property
    def cancel_check(self) -> Callable[[], bool]:
        """A callable answering ``cancel_requested`` for this thread's attempt, from any thread.

        Read it in ``handle``'s thread, where it binds the attempt being run
        there, then pass it to long calls: ``upload(path,
        should_stop=self.cancel_check)``. Called from any thread (a
        ``ThreadPoolExecutor``, a transfer manager's progress callback,
        ``async_to_sync``), it returns True once the worker heard of that
        attempt's cancel request, and only that attempt's (a later attempt
        of the same row has its own). Outside a worker's attempt it always
        returns False.
        """
        item = _current_item()
        attempt = None if item is None else item.__dict__.get(ATTEMPT_ATTR)
        if attempt is None:
            return _never
        return lambda: bool(getattr(attempt, "cancel_requested", False))

    def handle(self, payload: Any) -> Any:
        """Do the work; the JSON-serialisable return value becomes ``result``.

        Declare it ``async def`` to run it on the worker's event loop, up to
        ASYNC_CONCURRENCY at once (``worker/event_loop.py``).
        """
        raise NotImplementedError(f"{type(self).__qualname__} must implement handle()")

    def handle_item(self, item: WorkItem) -> Any:
        """Run one claimed row: ``handle(item.payload)`` unless a subclass needs the row.

        What the worker calls. Override it (rarely) to see the attempt
        itself, its id, ``attempts`` and ``claimed_by``, as the Django Tasks
        backend does to build a task's context.
        """
        return self.handle(item.payload)

    def attempt_started(self, item: WorkItem) -> None:
        """Hook: an attempt of ``item`` is about to run. Does nothing by default.

        Called in the thread that runs it, before ``handle_item`` and outside
        the transaction of an ``atomic`` handler; an exception counts as the
        attempt's failure. The Django Tasks backend sends ``task_started``
        here. The attempt's timeout is running already: a slow hook can find,
        once it returns, that the attempt was recorded meanwhile
        (``attempt_was_recorded``).
        """

    def attempt_recorded(
        self, item: WorkItem, status: str | None, error: BaseException | None
    ) -> None:
        """Hook: an attempt's outcome is written. Does nothing by default.

        ``status`` is what the row is now: ``succeeded``, ``pending`` (a retry
        is due later) or ``failed``; None when the attempt no longer owns the
        row (fenced out, or no outcome could be written), in which case
        someone else records the row's fate. ``error`` is the exception that
        failed the attempt. Called once per attempt, after the write
        committed and outside any transaction of the attempt: from the
        worker thread that wrote a failure, or from the worker's hook
        thread for successes the success writer recorded and for rows stale
        recovery failed because their attempts ran out (then by the
        recovering worker, with the row as it is now). What it raises is
        logged, never more. The Django Tasks backend sends ``task_finished``
        here.
        """

    def backoff(self, attempt: int) -> float:
        """Seconds before the next attempt after failed attempt number ``attempt``."""
        return exponential_backoff(
            attempt,
            base=float(dbworker_settings.RETRY_BACKOFF),
            cap=float(dbworker_settings.RETRY_BACKOFF_MAX),
        )

    @classmethod
    def get_max_attempts(cls) -> int:
        value = cls.max_attempts
        return int(dbworker_settings.MAX_ATTEMPTS if value is None else value)

    # -- enqueue ----------------------------------------------------------------
    # The implementation lives in ``django_dbworker.enqueuing``, a layer above
    # the declarations; it reaches these class methods through the port below,
    # connected by the app's ``ready()``, so this module never imports upward.

    @classmethod
    def enqueue(
        cls,
        payload: Any = None,
        *,
        run_after: datetime | timedelta | None = None,
        priority: int = 0,
        queue: str | None = None,
        unique_key: str | None = None,
        concurrency_key: str | None = None,
        fair_key: str | None = None,
        using: str | None = None,
        after: Iterable[WorkItem | int] | None = None,
    ) -> WorkItem:
        """Insert one item for this handler; see ``django_dbworker.enqueue``."""
        options = EnqueueOptions(
            run_after=run_after,
            priority=priority,
            queue=queue,
            unique_key=unique_key,
            concurrency_key=concurrency_key,
            fair_key=fair_key,
            using=using,
            after=after,
        )
        return _enqueuer().insert_one(cls, payload, options)[0]

    @classmethod
    def enqueue_many(
        cls,
        payloads: Iterable[Any],
        *,
        run_after: datetime | timedelta | None = None,
        priority: int = 0,
        queue: str | None = None,
        concurrency_key: str | None = None,
        fair_key: str | None = None,
        using: str | None = None,
    ) -> list[WorkItem]:
        """Insert one item per payload in one bulk write; see ``django_dbworker.enqueue_many``."""
        options = EnqueueOptions(
            run_after=run_after,
            priority=priority,
            queue=queue,
            concurrency_key=concurrency_key,
            fair_key=fair_key,
            using=using,
        )
        return _enqueuer().insert_many(cls, payloads, options)

    @classmethod
    async def aenqueue(
        cls,
        payload: Any = None,
        *,
        run_after: datetime | timedelta | None = None,
        priority: int = 0,
        queue: str | None = None,
        unique_key: str | None = None,
        concurrency_key: str | None = None,
        fair_key: str | None = None,
        using: str | None = None,
        after: Iterable[WorkItem | int] | None = None,
    ) -> WorkItem:
        """``enqueue`` from async code: the same insert, on Django's thread for sync
        database work (``sync_to_async``), so it joins no transaction of the caller."""
        from asgiref.sync import sync_to_async

        return await sync_to_async(cls.enqueue)(
            payload,
            run_after=run_after,
            priority=priority,
            queue=queue,
            unique_key=unique_key,
            concurrency_key=concurrency_key,
            fair_key=fair_key,
            using=using,
            after=after,
        )

    # -- not driven on its own ----------------------------------------------------
    # WorkItem handlers run in run_workers' shared claim loop (and in
    # ``testing.run_until_empty``), which claims for all of them at once.

    def claim(self) -> WorkItem:
        raise TypeError(
            f"{type(self).__qualname__} is a WorkItemHandler: run_workers claims its items "
            "in the shared claim loop; it has no claim() of its own."
        )

    def process(self, item: WorkItem) -> None:
        raise TypeError(
            f"{type(self).__qualname__} is a WorkItemHandler: run_workers runs its items; "
            "call handle(payload) to run one payload directly."
        )


def runs_async(cls: type[WorkItemHandler]) -> bool:
    """Whether the worker runs ``cls``'s items on its event loop: its ``handle_item``
    (or, not overridden, its ``handle``) is ``async def``."""
    if cls.handle_item is not WorkItemHandler.handle_item:
        return inspect.iscoroutinefunction(cls.handle_item)
    return inspect.iscoroutinefunction(cls.handle)


def unimplemented(cls: type[Handler[Any]]) -> list[str]:
    """The methods an own-table ``Handler[T]`` must override and does not.

    Without ``claim`` the loop would never find work and without ``process``
    every item would fail; ``run_workers`` refuses to start instead.
    ``WorkItemHandler`` subclasses are run by the shared loop: nothing to check.
    """
    if issubclass(cls, WorkItemHandler):
        return []
    return [name for name in ("claim", "process") if getattr(cls, name) is getattr(Handler, name)]


class Enqueuer(Protocol):
    """What the enqueue class methods need: ``django_dbworker.enqueuing`` provides it."""

    def insert_one(
        self, handler: type[WorkItemHandler], payload: Any, options: EnqueueOptions
    ) -> tuple[WorkItem, bool]: ...

    def insert_many(
        self, handler: type[WorkItemHandler], payloads: Iterable[Any], options: EnqueueOptions
    ) -> list[WorkItem]: ...


#: The attribute of an attempt's ``WorkItem`` instance that points to the
#: worker's record of the attempt (``worker/attempts.py``).
ATTEMPT_ATTR = "_dbworker_attempt"


def attempt_was_recorded(item: WorkItem) -> bool:
    """Whether the attempt ``item`` holds has been recorded (its ending settled).

    The worker keeps this on its record of the attempt, which the thread
    running the attempt and the thread recording it share: a timed-out
    attempt is recorded by the thread that waited for it while its
    abandoned run may still go on (``attempt_started`` of the Tasks backend
    asks, after a slow read). False for an item no worker runs.
    """
    return bool(getattr(item.__dict__.get(ATTEMPT_ATTR), "recorded", False))


def cancel_was_requested(item: WorkItem) -> bool:
    """Whether the worker heard of a cancel request for the attempt ``item`` holds.

    The heartbeat marks the worker's record of the attempt (keyed by row id
    and claim token, ``worker/attempts.py``); False for an item no worker runs.
    """
    return bool(getattr(item.__dict__.get(ATTEMPT_ATTR), "cancel_requested", False))


def _never() -> bool:
    """``cancel_check`` outside a worker's attempt: no request can reach it."""
    return False


#: The attempt each thread is running (``running_attempt``), for ``cancel_requested``.
_running = threading.local()
#: The attempt an async handler's coroutine runs (``running_async_attempt``): a
#: context variable, since one loop thread runs many attempts at once.
_running_async: ContextVar[WorkItem | None] = ContextVar("dbworker_attempt", default=None)


def _current_item() -> WorkItem | None:
    return getattr(_running, "item", None) or _running_async.get()


def running_async_attempt(item: WorkItem) -> None:
    """The calling task (and what it starts after this) runs the attempt ``item`` holds.

    Set in the task of one attempt on the worker's loop, which ends with it:
    nothing to reset.
    """
    _running_async.set(item)


@contextmanager
def running_attempt(item: WorkItem) -> Iterator[None]:
    """The calling thread runs the attempt ``item`` holds (the worker wraps ``handle`` in it)."""
    previous = getattr(_running, "item", None)
    _running.item = item
    try:
        yield
    finally:
        _running.item = previous


_port: list[Enqueuer] = []


def connect_enqueuer(enqueuer: Enqueuer) -> None:
    """Plug in the enqueue implementation (``DBWorkerConfig.ready`` does)."""
    _port[:] = [enqueuer]


def insert(
    cls: type[WorkItemHandler], payload: Any, options: EnqueueOptions
) -> tuple[WorkItem, bool]:
    """The one insert path (``enqueuing.insert_one``), for the package's own enqueues
    from below enqueuing's layer (a batch's callback, ``batches/completion.py``)."""
    return _enqueuer().insert_one(cls, payload, options)


def _enqueuer() -> Enqueuer:
    if not _port:
        raise ImproperlyConfigured(
            "django_dbworker is not ready: add it to INSTALLED_APPS and call django.setup() "
            "before enqueueing."
        )
    return _port[0]
