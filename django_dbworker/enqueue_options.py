"""The options of an enqueue, spelled once: their defaults, their checks, the columns they fill.

``django_dbworker.enqueue`` / ``enqueue_many``, the ``WorkItemHandler``
class methods and the Django Tasks backend take these options as keywords
(explicit public signatures, so that ``help()``, the docs and IDEs show
every name) and turn them into one ``EnqueueOptions`` at once; everything
below them (the ``Enqueuer`` port in ``handlers.py``, ``enqueuing.py``)
passes that one object. Adding an option is a field here, its check in
``EnqueueOptions.columns``, and the public signatures.

A declaration: imports only ``errors`` and ``validation`` (the handler
class for its type only), reads Django's ``USE_TZ``, never touches the
database.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db.models.functions import Now
from django.utils import timezone

from django_dbworker import validation
from django_dbworker.errors import EnqueueError
from django_dbworker.validation import PRIORITY_MAX, PRIORITY_MIN, unstorable_text

if TYPE_CHECKING:
    from django.db.models import Expression

    from django_dbworker.handlers import WorkItemHandler


@dataclass(frozen=True, slots=True)
class EnqueueOptions:
    """How to enqueue, as the caller said it; checked by ``columns``, not when made.

    Checked late on purpose: the payload is checked before the options, and
    ``enqueue_many`` checks them with its first payload (a bad queue reads
    "Payload #0: ...", and an empty batch checks nothing).
    """

    #: When the item may run: an aware datetime, or a delay after now by the
    #: database's clock. None: now.
    run_after: datetime | timedelta | None = None
    #: Higher runs first: PRIORITY_MIN..PRIORITY_MAX.
    priority: int = 0
    #: The queue; None: the handler's ``queue``.
    queue: str | None = None
    #: At most one live (pending or claimed) item per handler and key; a second
    #: enqueue returns the live one.
    unique_key: str | None = None
    #: Attempts before the item ends ``failed``; None: the handler's.
    max_attempts: int | None = None
    #: At most the handler's ``concurrency_limit`` items of one handler and key
    #: are claimed at once; None: no limit. The limit is copied onto the row
    #: with the key (a key without a handler limit is stored, unlimited).
    concurrency_key: str | None = None
    #: The item's fair key (``flow/fair.py``): among ready rows of one priority, claims
    #: take turns across the keys with ready work; None: the handler's ``fair_key``.
    fair_key: str | None = None
    #: The database alias to write to; None: the routers' write alias.
    using: str | None = None
    #: Work items (or ids) that must succeed before this one runs
    #: (``dependencies.py``); None: none.
    after: Any = None

    def columns(self, handler: type[WorkItemHandler]) -> dict[str, Any]:
        """The checked values of the columns these options fill, ``run_after`` apart.

        Raises ``EnqueueError`` for the first option at fault, in this order.
        """
        return {
            "queue": _check_queue(handler.queue if self.queue is None else self.queue),
            "priority": _check_priority(self.priority),
            "max_attempts": (
                handler.get_max_attempts()
                if self.max_attempts is None
                else _check_max_attempts(self.max_attempts)
            ),
            "unique_key": _check_unique_key(self.unique_key),
            **_concurrency_columns(handler, self.concurrency_key),
            "fair_key": _check_fair_key(
                getattr(handler, "fair_key", None) if self.fair_key is None else self.fair_key
            ),
        }

    def run_after_value(self) -> datetime | Expression | None:
        """None (the column's DB-clock default), an aware datetime, or now() + delta.

        A new value per call: ``enqueue_many`` gives each item its own.
        """
        run_after = self.run_after
        if run_after is None:
            return None
        if isinstance(run_after, timedelta):
            # Relative delays are added to the database's clock, not this host's.
            return Now() + run_after
        if isinstance(run_after, datetime):
            if settings.USE_TZ and timezone.is_naive(run_after):
                raise EnqueueError(
                    f"run_after {run_after!r} is a naive datetime while USE_TZ is on; "
                    "pass an aware datetime or a timedelta."
                )
            return run_after
        raise EnqueueError(
            f"run_after must be a datetime or a timedelta, got {type(run_after).__name__}."
        )


def _check_priority(priority: Any) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise EnqueueError(f"Priority must be an integer, got {priority!r}.")
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise EnqueueError(f"Priority {priority} is out of range {PRIORITY_MIN}..{PRIORITY_MAX}.")
    return priority


def _check_queue(queue: Any) -> str:
    try:
        return validation.queue_name(queue)
    except validation.InvalidValue:
        raise EnqueueError(
            f"Queue name {queue!r} is invalid: use 1 to 100 characters of [A-Za-z0-9_.:-]."
        ) from None


def _check_unique_key(key: Any) -> str | None:
    if key is None:
        return None
    if not isinstance(key, str) or not 1 <= len(key) <= 255:
        raise EnqueueError(f"unique_key must be a string of 1 to 255 characters, got {key!r}.")
    problem = unstorable_text(key)
    if problem is not None:
        # Refused everywhere, like payloads; the message does not quote the key.
        raise EnqueueError(f"unique_key contains {problem}, which is not allowed.")
    return key


#: The concurrency_key column's width.
MAX_CONCURRENCY_KEY = 200


def _concurrency_columns(handler: type[WorkItemHandler], key: Any) -> dict[str, Any]:
    """``concurrency_key`` and ``concurrency_limit`` for a row; both None without a key.

    The limit is the handler's at enqueue, informational (the admin shows
    it): the claim holds a key to its handler's current declaration.
    """
    if key is None:
        return {"concurrency_key": None, "concurrency_limit": None}
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_CONCURRENCY_KEY:
        if isinstance(key, str):
            got = f"a string of {len(key)} characters"
        else:
            got = f"{type(key).__name__} {key!r}"[:80]
        raise EnqueueError(
            f"concurrency_key must be a string of 1 to {MAX_CONCURRENCY_KEY} characters or "
            f"None, got {got}."
        )
    problem = unstorable_text(key)
    if problem is not None:
        raise EnqueueError(f"concurrency_key contains {problem}, which is not allowed.")
    limit = handler.concurrency_limit
    problem = validation.concurrency_limit_problem(limit)
    if problem is not None:
        # The system check (E021) says so at start-up; an enqueue that runs
        # anyway must not store a limit the claim cannot honour.
        raise EnqueueError(f"Handler {handler.name!r} has a bad concurrency_limit: {problem}.")
    return {"concurrency_key": key, "concurrency_limit": limit}


def _check_fair_key(key: Any) -> str | None:
    try:
        return validation.fair_key(key)
    except validation.InvalidValue as exc:
        raise EnqueueError(f"fair_key {exc}.") from None


def _check_max_attempts(value: Any) -> int:
    try:
        return validation.positive_int(value)
    except validation.InvalidValue as exc:
        raise EnqueueError(f"max_attempts {exc}.") from None
