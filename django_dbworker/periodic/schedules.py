"""Schedule maths: which instants a periodic schedule has, and how to say it in words.

Intervals (``every``), 5-field cron expressions (via cronsim) on the wall
clock of an IANA time zone, the first slot after and the last at or before
an instant, a slot as text (``slot_key``) and back. Pure functions of time:
nothing here touches the database, the clock or a handler; the
``PeriodicHandler`` declaration (``periodic.py``) and the worker's scheduler
(``worker/scheduler.py``) build on it.

Slots are absolute instants, the same for every process whatever its start
time: interval schedules are aligned to the Unix epoch (``every = 3600``
runs on the hour, UTC), cron schedules follow the wall clock of their
``timezone``, with daylight-saving changes handled as Debian's cron does
(a fixed-time job in a skipped hour runs once right after the change, one
in a repeated hour runs once, the first time).
"""

from __future__ import annotations

import math
import zoneinfo
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any, Protocol

#: The shortest interval ``every`` accepts, in seconds.
MIN_EVERY = 1.0
#: The five cron fields, in order (SPEC: 5-field expressions).
CRON_FIELDS = ("minute", "hour", "day-of-month", "month", "day-of-week")
#: The shortcuts of Vixie/Debian cron (crontab(5)) and the expressions they stand for.
CRON_SHORTCUTS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)


class InvalidSchedule(ValueError):
    """A periodic handler's declaration cannot make a schedule; the message says why.

    ``field`` names the attribute at fault (``every_or_cron``, ``every``,
    ``cron``, ``timezone``, ``jitter``): each has its own system check id.
    """

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class Schedule(Protocol):
    """The slots of one periodic handler: aware datetimes, compared as instants."""

    def latest(self, at: datetime) -> datetime | None:
        """The last slot at or before ``at``; None if there is none (a cron that never fired)."""
        ...

    def following(self, after: datetime) -> datetime | None:
        """The first slot strictly after ``after``; None if there is none."""
        ...

    def describe(self) -> str:
        """The schedule in words: "every 5 minutes", "at 03:00 every day (Europe/Paris)"."""
        ...


# -- intervals --------------------------------------------------------------------


@dataclass(frozen=True)
class IntervalSchedule:
    """Every ``seconds`` seconds, on multiples of it since the Unix epoch (UTC).

    Epoch alignment makes the slots the same in every process without any
    shared state: two workers started a second apart agree on them.
    Microsecond arithmetic in integers: no float drift over years.
    """

    seconds: float

    @property
    def _step(self) -> int:
        return max(1, round(self.seconds * 1_000_000))

    def latest(self, at: datetime) -> datetime:
        since = (at - _EPOCH) // _US
        return _EPOCH + (since - since % self._step) * _US

    def following(self, after: datetime) -> datetime:
        return self.latest(after) + self._step * _US

    def describe(self) -> str:
        return "every " + _duration_words(self.seconds)


def _duration_words(seconds: float) -> str:
    """``5 minutes``, ``hour``, ``90 seconds``, ``1.5 seconds``."""
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            count = int(seconds // size)
            return unit if count == 1 else f"{count} {unit}s"
    if seconds == 1:
        return "second"
    return f"{seconds:g} seconds"


# -- cron -------------------------------------------------------------------------
#
# We use cronsim (https://github.com/cuu508/cronsim), not our own parser and
# not croniter: cronsim is small, pure Python with no dependencies, typed,
# maintained (it runs Healthchecks.io's cron checks), iterates backwards as
# well as forwards (what "the latest missed slot" needs), explains an
# expression in English, and documents that it reproduces Debian cron's
# daylight-saving behaviour. croniter handles DST differently from cron and
# its maintenance has been uncertain. Everything cronsim-specific stays
# behind ``CronExpression``, so swapping the library is one class.


class CronExpression:
    """A validated 5-field cron expression evaluated in one time zone.

    A shortcut (``@daily``, crontab(5)) stands for its expression; ``expr``
    is then the five fields (cronsim knows no shortcuts).
    """

    def __init__(self, expr: str, tz: tzinfo) -> None:
        from cronsim import CronSim, CronSimError

        self._cronsim = CronSim
        self.expr = _expand_shortcut(expr)
        self.tz = tz
        fields = self.expr.split()
        if len(fields) != len(CRON_FIELDS):
            raise InvalidSchedule(
                f"cron {expr!r} has {len(fields)} field(s); it needs 5 ({' '.join(CRON_FIELDS)})",
                field="cron",
            )
        try:
            self._probe = CronSim(self.expr, datetime(2000, 1, 1, tzinfo=UTC))
        except CronSimError as exc:
            raise InvalidSchedule(_cron_problem(expr, fields, str(exc)), field="cron") from None
        except Exception as exc:  # cronsim may raise others on odd input
            raise InvalidSchedule(f"cron {expr!r} is invalid: {exc}", field="cron") from None

    def _local(self, at: datetime) -> datetime:
        return at.astimezone(self.tz)

    def after(self, at: datetime) -> datetime | None:
        """The first firing strictly after ``at``."""
        try:
            return next(self._cronsim(self.expr, self._local(at))).astimezone(UTC)
        except StopIteration:
            return None

    def at_or_before(self, at: datetime) -> datetime | None:
        """The last firing at or before ``at``.

        cronsim's reverse iteration yields firings strictly before its start
        (whole seconds); starting one second past ``at`` (floored) includes
        a firing at ``at`` itself. Cron firings are whole minutes, so the
        flooring loses nothing.
        """
        # The arithmetic in UTC: wall-clock arithmetic loses the fold of a
        # repeated hour.
        start = self._local(at.astimezone(UTC).replace(microsecond=0) + timedelta(seconds=1))
        try:
            return next(self._cronsim(self.expr, start, reverse=True)).astimezone(UTC)
        except StopIteration:
            return None

    def explain(self) -> str:
        try:
            text = str(self._probe.explain())
        except Exception:  # explain() is best effort; the schedule itself is fine
            return f"cron {self.expr}"
        return text[:1].lower() + text[1:]


def _expand_shortcut(expr: str) -> str:
    """``@daily`` as ``0 0 * * *``; other expressions with their blanks normalised."""
    text = " ".join(expr.split())
    if not text.startswith("@"):
        return text
    word = text.lower()
    if word in CRON_SHORTCUTS:
        return CRON_SHORTCUTS[word]
    if word == "@reboot":
        raise InvalidSchedule(
            f"cron {expr!r} has no slots: a periodic handler runs on a schedule, not at "
            "start-up (enqueue from AppConfig.ready() or a deploy step instead)",
            field="cron",
        )
    raise InvalidSchedule(
        f"cron {expr!r} is not a cron shortcut ({', '.join(CRON_SHORTCUTS)}) nor 5 fields",
        field="cron",
    )


def _cron_problem(expr: str, fields: list[str], message: str) -> str:
    """cronsim's "Bad hour" as "cron '0 25 * * *': the hour field '25' is invalid"."""
    for index, name in enumerate(CRON_FIELDS):
        if message.lower() == f"bad {name}":
            return f"cron {expr!r}: the {name} field {fields[index]!r} is invalid"
    return f"cron {expr!r} is invalid: {message}"


@dataclass(frozen=True)
class CronSchedule:
    """The firings of a cron expression on the wall clock of ``tz``."""

    expression: CronExpression

    def latest(self, at: datetime) -> datetime | None:
        return self.expression.at_or_before(at)

    def following(self, after: datetime) -> datetime | None:
        return self.expression.after(after)

    def describe(self) -> str:
        return f"{self.expression.explain()} ({self.expression.tz})"


def time_zone(name: Any) -> tzinfo:
    """The IANA time zone ``name``; raises ``InvalidSchedule`` for an unknown one."""
    if not isinstance(name, str) or not name:
        raise InvalidSchedule(
            f"timezone must be an IANA name such as 'Europe/Paris', not {name!r}", field="timezone"
        )
    if name == "UTC":
        return UTC
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise InvalidSchedule(
            f"timezone {name!r} is not a known IANA time zone (such as 'Europe/Paris')",
            field="timezone",
        ) from None


def make_schedule(
    *, every: Any = None, cron: Any = None, timezone: Any = "UTC"
) -> IntervalSchedule | CronSchedule:
    """The schedule a declaration asks for; raises ``InvalidSchedule`` saying what is wrong."""
    if every is not None and cron is not None:
        raise InvalidSchedule(
            "sets both `every` and `cron`; set exactly one", field="every_or_cron"
        )
    if every is None and cron is None:
        raise InvalidSchedule(
            "sets neither `every` nor `cron`; set exactly one", field="every_or_cron"
        )
    if every is not None:
        if isinstance(every, timedelta):
            every = every.total_seconds()
        if isinstance(every, bool) or not isinstance(every, (int, float)):
            raise InvalidSchedule(
                f"`every` must be a number of seconds, not {every!r}", field="every"
            )
        if not math.isfinite(every) or every < MIN_EVERY:
            raise InvalidSchedule(
                f"`every` is {every!r} seconds; the shortest is {MIN_EVERY:g}", field="every"
            )
        return IntervalSchedule(float(every))
    if not isinstance(cron, str):
        raise InvalidSchedule(
            f"`cron` must be a string such as '0 3 * * *', not {cron!r}", field="cron"
        )
    return CronSchedule(CronExpression(cron, time_zone(timezone)))


def taken_until(schedule: Schedule, last_slot: datetime | None, created_at: datetime) -> datetime:
    """The instant up to which a schedule row's slots count as taken.

    Its ``last_slot``; for a row that has taken none yet, the last slot
    before the row was created (or its creation): a new schedule starts
    with the first slot after it exists, not with one that passed before.
    """
    if last_slot is not None:
        return last_slot
    return schedule.latest(created_at) or created_at


def check_jitter(value: Any) -> float:
    """``jitter`` as seconds; raises ``InvalidSchedule`` unless a finite number >= 0."""
    if value is None:
        return 0.0
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise InvalidSchedule(
            f"`jitter` must be a non-negative number of seconds, not {value!r}", field="jitter"
        )
    return float(value)


def slot_key(slot: datetime) -> str:
    """A slot as text: the WorkItem's ``unique_key`` and the payload's ``slot``.

    ISO 8601 in UTC, so one instant always has one key.
    """
    return slot.astimezone(UTC).isoformat()


def parse_slot(text: str) -> datetime:
    """The inverse of ``slot_key``."""
    value = datetime.fromisoformat(text)
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
