"""Named validators for worker parameters, shared by every place that takes them.

The ``DBWORKER`` system checks (``checks.py``), the ``run_workers`` flags and
``WorkerConfig`` all validate through these, so "a positive integer", "a
port" or "a queue name" means the same thing (and says the same thing) in a
settings file, on a command line and in code. A declaration: imports nothing
from the package, reads no settings, never touches the database.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

V = TypeVar("V")
Validator = Callable[[Any], Any]

#: What ``enqueue`` accepts as a queue name (SPEC: ``[A-Za-z0-9_.:-]{1,100}``).
QUEUE_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,100}")
#: The priorities ``enqueue`` accepts (SPEC: -100..100; a constraint of the table too).
PRIORITY_MIN = -100
PRIORITY_MAX = 100


class InvalidValue(ValueError):
    """A value outside its domain; the message reads after the value's name.

    ``wrong_type`` tells a value of the wrong type (``"8"`` for an integer)
    from one of the right type out of range, so the checks can keep their ids;
    ``too_long`` marks a number of seconds no thread can wait for (its own id).
    """

    def __init__(self, message: str, *, wrong_type: bool = False, too_long: bool = False) -> None:
        super().__init__(message)
        self.wrong_type = wrong_type
        self.too_long = too_long


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive_int(value: Any) -> int:
    if not _is_int(value):
        raise InvalidValue(f"must be an integer, got {value!r}", wrong_type=True)
    if value < 1:
        raise InvalidValue(f"must be at least 1, got {value!r}")
    return int(value)


#: The largest ``concurrency_limit`` the column stores (a 32-bit integer on every vendor).
CONCURRENCY_LIMIT_MAX = 2**31 - 1


def concurrency_limit_problem(value: Any) -> str | None:
    """What is wrong with a handler's ``concurrency_limit``, or None (None itself is fine).

    An int of at least 1; a bool is not an int here (``True`` is no limit
    anyone means), nor is ``"2"``.
    """
    if value is None:
        return None
    if not _is_int(value):
        return f"it must be an integer of at least 1 or None, got {value!r}"
    if not 1 <= value <= CONCURRENCY_LIMIT_MAX:
        return f"it must be between 1 and {CONCURRENCY_LIMIT_MAX}, got {value!r}"
    return None


#: A fair key's width (``WorkItem.fair_key``, ``FairKey.key``).
FAIR_KEY_MAX = 200


def fair_key(value: Any) -> str | None:
    """A fair key: None, or a string of 1 to ``FAIR_KEY_MAX`` characters any database stores."""
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= FAIR_KEY_MAX:
        got = (
            f"a string of {len(value)} characters"
            if isinstance(value, str)
            else f"{type(value).__name__} {value!r}"[:80]
        )
        raise InvalidValue(
            f"must be a string of 1 to {FAIR_KEY_MAX} characters or None, got {got}",
            wrong_type=not isinstance(value, str),
        )
    problem = unstorable_text(value)
    if problem is not None:
        raise InvalidValue(f"contains {problem}, which is not allowed")
    return value


def fair_weight(value: Any) -> float:
    """A fair key's weight: a finite number greater than 0 (at most a million)."""
    number = positive_number(value)
    if not math.isfinite(number) or number > 1e6:
        raise InvalidValue(f"must be a finite number of at most 1000000, got {value!r}")
    return number


def non_negative_int(value: Any) -> int:
    if not _is_int(value):
        raise InvalidValue(f"must be an integer, got {value!r}", wrong_type=True)
    if value < 0:
        raise InvalidValue(f"must be 0 or more, got {value!r}")
    return int(value)


def positive_number(value: Any) -> float:
    if not _is_number(value):
        raise InvalidValue(f"must be a number, got {value!r}", wrong_type=True)
    if not value > 0:  # NaN too
        raise InvalidValue(f"must be greater than 0, got {value!r}")
    return float(value)


def _waitable(number: float, value: Any) -> float:
    # Condition.wait and Lock.acquire raise OverflowError above TIMEOUT_MAX
    # (and for inf): a worker would crash at its first idle wait.
    if not math.isfinite(number) or number > threading.TIMEOUT_MAX:
        raise InvalidValue(
            "must be a finite number of seconds, at most threading.TIMEOUT_MAX "
            f"({threading.TIMEOUT_MAX:.0f}), got {value!r}",
            too_long=True,
        )
    return number


def timeout_seconds(value: Any) -> float:
    """A positive, finite number of seconds that a thread can wait for."""
    return _waitable(positive_number(value), value)


def wait_or_zero_seconds(value: Any) -> float:
    """0 or a positive, finite number of seconds that a thread can wait for."""
    return _waitable(non_negative_number(value), value)


def non_negative_number(value: Any) -> float:
    if not _is_number(value):
        raise InvalidValue(f"must be a number, got {value!r}", wrong_type=True)
    if not value >= 0:  # NaN too
        raise InvalidValue(f"must be 0 or more, got {value!r}")
    return float(value)


def port(value: Any) -> int:
    if not _is_int(value) or not 0 < value < 65536:
        raise InvalidValue(
            f"is not a port number (1-65535), got {value!r}", wrong_type=not _is_int(value)
        )
    return int(value)


def non_empty_str(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidValue(f"must be a non-empty string, got {value!r}", wrong_type=True)
    return value


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidValue(f"must be True or False, got {value!r}", wrong_type=True)
    return value


def queue_name(value: Any) -> str:
    if not isinstance(value, str) or not QUEUE_NAME.fullmatch(value):
        raise InvalidValue(
            f"is not a valid queue name: use 1 to 100 characters of [A-Za-z0-9_.:-], got {value!r}",
            wrong_type=not isinstance(value, str),
        )
    return value


#: A handler's ``rate_limit``: "N/s", "N/m" or "N/h", N a positive integer.
RATE_LIMIT = re.compile(r"(?P<count>[0-9]+)/(?P<unit>[smh])")
#: Seconds in each unit of a ``rate_limit``.
RATE_PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def rate_limit(value: Any) -> tuple[int, float]:
    """``(starts, period in seconds)`` of a ``rate_limit`` such as ``"50/s"``."""
    if not isinstance(value, str):
        raise InvalidValue(
            f'must be a string such as "50/s", "100/m" or "1000/h", got {value!r}',
            wrong_type=True,
        )
    match = RATE_LIMIT.fullmatch(value)
    if match is None:
        raise InvalidValue(
            f'must read "N/s", "N/m" or "N/h" (N starts per second, minute or hour), got {value!r}'
        )
    count = int(match["count"])
    if count < 1:
        raise InvalidValue(f"must allow at least 1 start per period, got {value!r}")
    return count, RATE_PERIODS[match["unit"]]


def optional(validator: Callable[[Any], V]) -> Callable[[Any], V | None]:
    """``validator`` that also accepts None ("not set")."""

    def check(value: Any) -> V | None:
        return None if value is None else validator(value)

    check.__name__ = f"optional_{validator.__name__}"
    return check


#: The statuses ``RETENTION`` may name (``models.FINISHED_STATUSES``, spelled
#: here because this module imports nothing of the package's).
RETAINED_STATUSES = ("succeeded", "failed", "cancelled")


def retention(value: Any) -> dict[str, float | None] | None:
    """``RETENTION``: None (keep every row), or ages in seconds per finished status.

    A dict names some of ``succeeded``, ``failed`` and ``cancelled``; each
    value is a positive number of seconds or a ``timedelta``, or None to keep
    that status forever. Statuses it leaves out keep their default age
    (``conf.RETENTION``). Returns the ages in seconds, merged over the defaults.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidValue(
            f"must be None or a dict of ages by status, got {value!r}", wrong_type=True
        )
    unknown = sorted(str(k) for k in value if k not in RETAINED_STATUSES)
    if unknown:
        raise InvalidValue(
            f"names {', '.join(unknown)}: the statuses are {', '.join(RETAINED_STATUSES)}"
        )
    ages: dict[str, float | None] = dict.fromkeys(RETAINED_STATUSES, None)
    ages.update(DEFAULT_RETENTION)
    for status, age in value.items():
        if isinstance(age, timedelta):
            age = age.total_seconds()
        if age is None:
            ages[status] = None
            continue
        try:
            ages[status] = positive_number(age)
        except InvalidValue as exc:
            raise InvalidValue(
                f"[{status!r}] {exc} (seconds, a timedelta, or None to keep them)",
                wrong_type=exc.wrong_type,
            ) from None
    return ages


#: Seconds a finished row is kept by default, per status: a week of history
#: for succeeded and cancelled rows, a month for failed ones (the rows an
#: operator comes back to). ``conf.RETENTION`` is this.
DEFAULT_RETENTION: Mapping[str, float | None] = {
    "succeeded": 7 * 86400.0,
    "cancelled": 7 * 86400.0,
    "failed": 30 * 86400.0,
}

#: ``DBWORKER`` keys and their validators (relations between keys: ``checks.py``).
SETTINGS: Mapping[str, Validator] = {
    "CONCURRENCY": positive_int,
    "ASYNC_CONCURRENCY": positive_int,
    # Seconds that reach a thread's wait (Condition.wait, Event.wait).
    "POLL_INTERVAL": timeout_seconds,
    "WAKEUPS": boolean,
    # A worker waits this long after a wake-up for its trailing claim.
    "WAKEUP_WINDOW": wait_or_zero_seconds,
    # An alias of DATABASES (checks.py says when it is not one, or not PostgreSQL).
    "WAKEUP_DATABASE": optional(non_empty_str),
    "BATCH_SIZE": non_negative_int,
    "PREFETCH_HORIZON": non_negative_number,
    "HEARTBEAT_INTERVAL": timeout_seconds,
    "STALE_AFTER": timeout_seconds,
    "SHUTDOWN_TIMEOUT": wait_or_zero_seconds,
    "MAX_ATTEMPTS": positive_int,
    "RETRY_BACKOFF": positive_number,
    "RETRY_BACKOFF_MAX": positive_number,
    "MAX_PAYLOAD_BYTES": positive_int,
    "MAX_ABANDONED_THREADS": optional(positive_int),
    "METRICS_PORT": optional(port),
    "METRICS_ADDR": non_empty_str,
    "RETENTION": retention,
}

#: Options of a Django task (``DBWorkerTask`` fields, lower case) and the
#: defaults for them in a ``DBWorkerBackend``'s ``OPTIONS`` (upper case).
TASK_OPTIONS: Mapping[str, Validator] = {
    "MAX_ATTEMPTS": optional(positive_int),
    "TIMEOUT": optional(timeout_seconds),
    "ATOMIC": optional(boolean),
    "SENSITIVE": optional(boolean),
}

#: ``WorkerConfig`` fields and their validators: the settings they default from.
WORKER_CONFIG: Mapping[str, Validator] = {
    "concurrency": SETTINGS["CONCURRENCY"],
    "async_concurrency": SETTINGS["ASYNC_CONCURRENCY"],
    "poll_interval": SETTINGS["POLL_INTERVAL"],
    "wakeups": SETTINGS["WAKEUPS"],
    "wakeup_window": SETTINGS["WAKEUP_WINDOW"],
    "wakeup_database": SETTINGS["WAKEUP_DATABASE"],
    "batch_size": SETTINGS["BATCH_SIZE"],
    "prefetch_horizon": SETTINGS["PREFETCH_HORIZON"],
    "heartbeat_interval": SETTINGS["HEARTBEAT_INTERVAL"],
    "stale_after": SETTINGS["STALE_AFTER"],
    "shutdown_timeout": SETTINGS["SHUTDOWN_TIMEOUT"],
    "max_abandoned_threads": SETTINGS["MAX_ABANDONED_THREADS"],
}


def validate_worker_config(config: Any) -> None:
    """Raise ``InvalidValue`` naming the first bad field of a ``WorkerConfig``."""
    for name, validator in WORKER_CONFIG.items():
        try:
            validator(getattr(config, name))
        except InvalidValue as exc:
            raise InvalidValue(f"WorkerConfig.{name} {exc}", wrong_type=exc.wrong_type) from None
    queues = getattr(config, "queues", None)
    if queues is not None:
        if isinstance(queues, str):
            raise InvalidValue(
                f"WorkerConfig.queues must be a list of queue names, got {queues!r}",
                wrong_type=True,
            )
        for queue in queues:
            try:
                queue_name(queue)
            except InvalidValue as exc:
                raise InvalidValue(f"WorkerConfig.queues: a queue name {exc}") from None


#: An unpaired surrogate in a Python string (what ``json.loads('"\\ud800"')``
#: or ``surrogateescape`` decoding makes); valid text never holds one.
_SURROGATE = re.compile("[\ud800-\udfff]")
NUL_CHARACTER = "a NUL character (\\u0000)"
LONE_SURROGATE = "a lone surrogate (U+D800-U+DFFF)"


def unstorable_text(text: str) -> str | None:
    """What in ``text`` no database can store ("a NUL character ..."), or None.

    PostgreSQL's text and jsonb refuse NUL (SQLite and MySQL would store
    it); a lone surrogate cannot be encoded as UTF-8 by any driver, and
    PostgreSQL's jsonb refuses its escape. Both are refused on every
    database, so a SQLite dev setup fails like PostgreSQL production, and
    before the database can answer with an error that quotes the row.
    """
    if "\x00" in text:
        return NUL_CHARACTER
    if not text.isascii() and _SURROGATE.search(text):
        return LONE_SURROGATE
    return None
