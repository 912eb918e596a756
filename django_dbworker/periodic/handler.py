"""Periodic work: the ``PeriodicHandler`` declaration.

A ``PeriodicHandler`` is a ``WorkItemHandler`` whose items the worker's
scheduler (``worker/scheduler.py``) creates, one per schedule slot, so each
run is an ordinary WorkItem: retried, recovered, traced and shown in the
admin like any other. The schedule maths (intervals, cron, time zones,
slots as text) lives in ``schedules.py``; its names are importable from here
too. This module never touches the database and imports nothing above the
handler declarations.
"""

from __future__ import annotations

import contextvars
import inspect
from datetime import UTC, datetime
from typing import Any, ClassVar

from django.core.exceptions import ImproperlyConfigured

from django_dbworker.handlers import WorkItemHandler
from django_dbworker.periodic.schedules import (
    CRON_FIELDS,
    MIN_EVERY,
    CronExpression,
    CronSchedule,
    IntervalSchedule,
    InvalidSchedule,
    Schedule,
    check_jitter,
    make_schedule,
    parse_slot,
    slot_key,
    taken_until,
    time_zone,
)

# The schedule maths' names stay importable from here, where they were first.
__all__ = [
    "CRON_FIELDS",
    "MIN_EVERY",
    "CronExpression",
    "CronSchedule",
    "IntervalSchedule",
    "InvalidSchedule",
    "PeriodicHandler",
    "Schedule",
    "check_jitter",
    "make_schedule",
    "parse_slot",
    "periodic_handlers",
    "slot_key",
    "taken_until",
    "time_zone",
]

#: The slot of the run executing in this context (thread); see ``PeriodicHandler.slot``.
_current_slot: contextvars.ContextVar[datetime | None] = contextvars.ContextVar(
    "dbworker_periodic_slot", default=None
)


class PeriodicHandler(WorkItemHandler):
    """Work on a schedule: ``run()`` once per slot, in the whole cluster.

    Set ``every`` (seconds) or ``cron`` (5 fields, on the wall clock of
    ``timezone``). Each slot becomes one WorkItem (``unique_key`` = the slot
    time in ISO 8601 UTC) enqueued by whichever worker gets there first;
    ``queue``, ``max_attempts``, ``timeout``, ``atomic``, ``sensitive`` and
    ``retry_on`` apply to it as to any WorkItemHandler.

    ``run(self)`` reads the slot being run as ``self.slot`` (per thread, so
    concurrent runs do not mix); ``run(self, slot)`` receives it instead.
    Use it to make a run idempotent ("the report of the day before
    ``slot``"), not ``now()``: a retried or caught-up run happens later than
    its slot.
    """

    abstract = True
    #: Seconds between slots (epoch-aligned); or set ``cron``.
    every: ClassVar[float | None] = None
    #: A 5-field cron expression (minute hour day-of-month month day-of-week),
    #: or a shortcut of crontab(5): ``@yearly`` (``@annually``), ``@monthly``,
    #: ``@weekly``, ``@daily`` (``@midnight``), ``@hourly``.
    cron: ClassVar[str | None] = None
    #: The IANA time zone of ``cron``'s wall clock.
    timezone: ClassVar[str] = "UTC"
    #: Up to this many seconds of random delay after the slot before the run
    #: may start (spreads many schedules due at the same instant).
    jitter: ClassVar[float] = 0.0

    #: Whether ``run`` takes the slot as an argument (set per class).
    _run_takes_slot: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        try:
            params = list(inspect.signature(cls.run).parameters.values())[1:]
        except (TypeError, ValueError):
            params = []
        cls._run_takes_slot = any(
            p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params
        ) or any(p.name == "slot" for p in params)

    @classmethod
    def scheduled(cls) -> bool:
        """Whether workers create this handler's slots (a setting may turn one off)."""
        return True

    @classmethod
    def get_schedule(cls) -> IntervalSchedule | CronSchedule:
        """The schedule this class declares; raises ``ImproperlyConfigured`` if it is invalid."""
        try:
            return make_schedule(every=cls.every, cron=cls.cron, timezone=cls.timezone)
        except InvalidSchedule as exc:
            raise ImproperlyConfigured(f"Periodic handler {cls.name!r} {exc}.") from None

    @classmethod
    def get_jitter(cls) -> float:
        """``jitter`` in seconds; raises ``ImproperlyConfigured`` if it is invalid."""
        try:
            return check_jitter(cls.jitter)
        except InvalidSchedule as exc:
            raise ImproperlyConfigured(f"Periodic handler {cls.name!r} {exc}.") from None

    @classmethod
    def declaration_problems(cls) -> list[InvalidSchedule]:
        """Everything wrong with this declaration (the system checks report them)."""
        problems = []
        for check in (
            lambda: make_schedule(every=cls.every, cron=cls.cron, timezone=cls.timezone),
            lambda: check_jitter(cls.jitter),
        ):
            try:
                check()
            except InvalidSchedule as exc:
                problems.append(exc)
        return problems

    @property
    def slot(self) -> datetime | None:
        """The slot of the run executing in this thread (None outside ``run``)."""
        return _current_slot.get()

    def run(self) -> Any:
        """Do the work of one slot; the JSON-serialisable return value becomes ``result``."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement run()")

    def handle(self, payload: Any) -> Any:
        """Run one slot's WorkItem: payload ``{"slot": "<ISO time>"}`` (plus ``manual``).

        An item enqueued by hand without a slot (``Nightly.enqueue()``) runs
        with the time it started as its slot.
        """
        has_slot = isinstance(payload, dict) and isinstance(payload.get("slot"), str)
        slot = parse_slot(payload["slot"]) if has_slot else datetime.now(UTC)
        token = _current_slot.set(slot)
        try:
            if self._run_takes_slot:
                return self.run(slot)  # type: ignore[call-arg]
            return self.run()
        finally:
            _current_slot.reset(token)


def periodic_handlers(classes: Any) -> list[type[PeriodicHandler]]:
    """The scheduled periodic handler classes among ``classes`` (classes or instances)."""
    found = []
    for entry in classes:
        cls = entry if isinstance(entry, type) else type(entry)
        if issubclass(cls, PeriodicHandler) and cls.scheduled():
            found.append(cls)
    return found
