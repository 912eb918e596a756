"""Handler base classes: the generic claim/process kit and the WorkItem handler.

A handler class is declared once and registers itself under ``name``. The
worker runtime creates one instance per class and process; handlers should
keep no per-item state on ``self`` since several threads call them at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from django_dbworker.backoff import exponential_backoff
from django_dbworker.conf import dbworker_settings
from django_dbworker.errors import NoTask
from django_dbworker.registry import registry

if TYPE_CHECKING:
    from django_dbworker.models import WorkItem

T = TypeVar("T")


class Handler(Generic[T]):
    """Claim one item, process it; optionally return stale items to the pool.

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
        """Claim and return one item, or raise ``NoTask``."""
        raise NoTask

    def process(self, item: T) -> None:
        """Do the work for one claimed item. Handles its own failures."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement process()")

    def recover_stale(self) -> None:
        """Return items abandoned by crashed workers; called at each cycle start."""

    def __repr__(self) -> str:
        return f"<{type(self).__qualname__} {self.name!r}>"


class WorkItemHandler(Handler["WorkItem"]):
    """A handler for jobs stored in the built-in ``WorkItem`` table.

    Subclasses implement ``handle(payload)``. Claiming, heartbeats, outcome
    recording, retries and stale recovery are provided, and all WorkItem
    handlers of a ``run_workers`` process share one claim loop.
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

    def handle(self, payload: Any) -> Any:
        """Do the work; the JSON-serialisable return value becomes ``result``."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement handle()")

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

    # -- enqueue ---------------------------------------------------------------

    @classmethod
    def enqueue(
        cls,
        payload: Any = None,
        *,
        run_after: datetime | timedelta | None = None,
        priority: int = 0,
        queue: str | None = None,
        unique_key: str | None = None,
        using: str | None = None,
    ) -> WorkItem:
        from django_dbworker.enqueuing import enqueue

        return enqueue(
            cls.name,
            payload,
            run_after=run_after,
            priority=priority,
            queue=queue,
            unique_key=unique_key,
            using=using,
        )

    @classmethod
    def enqueue_many(
        cls,
        payloads: Iterable[Any],
        *,
        run_after: datetime | timedelta | None = None,
        priority: int = 0,
        queue: str | None = None,
        using: str | None = None,
    ) -> list[WorkItem]:
        from django_dbworker.enqueuing import enqueue_many

        return enqueue_many(
            cls.name, payloads, run_after=run_after, priority=priority, queue=queue, using=using
        )

    # -- the Handler[T] protocol, for driving one handler on its own ----------

    def claim(self) -> WorkItem:
        from django_dbworker.db import operations
        from django_dbworker.worker.identity import worker_id

        items = operations().claim(limit=1, handlers=[self.name], queues=None, worker=worker_id())
        if not items:
            raise NoTask
        return items[0]

    def process(self, item: WorkItem) -> None:
        from django_dbworker.worker.execution import execute

        execute(item, self)

    def recover_stale(self) -> None:
        from django_dbworker import transitions

        transitions.recover_stale(handlers=[self.name])
