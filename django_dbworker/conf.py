"""The ``DBWORKER`` settings: named defaults, typed access, reset on change.

Holds no logic beyond reading settings; the values are validated by
``validation.SETTINGS``, reported by ``checks.py`` so that ``manage.py check``
reports every problem at once.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings as django_settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from django_dbworker.validation import DEFAULT_RETENTION

#: Worker threads per ``run_workers`` process.
CONCURRENCY = 8
#: Async handlers (``async def handle``) running at once per ``run_workers``
#: process, on its event loop, beside the CONCURRENCY threads.
ASYNC_CONCURRENCY = 100
#: Seconds between idle polls when no wake-up arrives.
POLL_INTERVAL = 1.0
#: Whether enqueues wake idle workers of other processes (PostgreSQL's
#: LISTEN/NOTIFY); False: no NOTIFY is sent, workers do not LISTEN and poll.
WAKEUPS = True
#: Seconds within which this process sends at most one wake-up per queue
#: (a more urgent row still sends one); 0 notifies inside every enqueue.
WAKEUP_WINDOW = 0.0
#: The database alias whose connection workers LISTEN on for wake-ups; None
#: is the work table's alias. Point it at an alias that reaches PostgreSQL
#: directly where the work alias goes through a pooler in transaction mode
#: (PgBouncer), which loses notifications.
WAKEUP_DATABASE: str | None = None
#: Most rows per claim query; 0 means "as many as the free threads and the
#: prefetch buffer need".
BATCH_SIZE = 0
#: Seconds of work a worker holds claimed beyond its running items, so its
#: threads go from job to job without waiting for a claim; 0 turns it off.
PREFETCH_HORIZON = 0.5
#: Seconds between heartbeats of in-flight rows.
HEARTBEAT_INTERVAL = 5.0
#: Heartbeat age (seconds) after which a claimed row counts as abandoned.
STALE_AFTER = 60.0
#: Seconds a stopping worker lets in-flight rows finish before releasing them.
SHUTDOWN_TIMEOUT = 30.0
#: Attempts before a failing item ends ``failed`` (handlers may override).
MAX_ATTEMPTS = 3
#: Base of the exponential retry backoff, in seconds.
RETRY_BACKOFF = 2.0
#: Upper bound of one backoff delay, in seconds.
RETRY_BACKOFF_MAX = 3600.0
#: Largest accepted payload, in bytes of its JSON encoding.
MAX_PAYLOAD_BYTES = 1048576
#: Handler threads abandoned after a timeout and still running at which a
#: worker stops claiming and exits non-zero; ``None`` means ``CONCURRENCY``.
MAX_ABANDONED_THREADS: int | None = None
#: Port for ``run_workers``'s ``/metrics``; ``None`` serves none.
METRICS_PORT: int | None = None
#: Address the metrics server binds to; loopback unless asked otherwise.
METRICS_ADDR = "127.0.0.1"
#: Seconds finished rows are kept, by status, before the workers' hourly
#: retention run deletes them (``retention.py``); None keeps every row.
RETENTION: dict[str, float | None] | None = dict(DEFAULT_RETENTION)

DEFAULTS: dict[str, Any] = {
    "CONCURRENCY": CONCURRENCY,
    "ASYNC_CONCURRENCY": ASYNC_CONCURRENCY,
    "POLL_INTERVAL": POLL_INTERVAL,
    "WAKEUPS": WAKEUPS,
    "WAKEUP_WINDOW": WAKEUP_WINDOW,
    "WAKEUP_DATABASE": WAKEUP_DATABASE,
    "BATCH_SIZE": BATCH_SIZE,
    "PREFETCH_HORIZON": PREFETCH_HORIZON,
    "HEARTBEAT_INTERVAL": HEARTBEAT_INTERVAL,
    "STALE_AFTER": STALE_AFTER,
    "SHUTDOWN_TIMEOUT": SHUTDOWN_TIMEOUT,
    "MAX_ATTEMPTS": MAX_ATTEMPTS,
    "RETRY_BACKOFF": RETRY_BACKOFF,
    "RETRY_BACKOFF_MAX": RETRY_BACKOFF_MAX,
    "MAX_PAYLOAD_BYTES": MAX_PAYLOAD_BYTES,
    "MAX_ABANDONED_THREADS": MAX_ABANDONED_THREADS,
    "METRICS_PORT": METRICS_PORT,
    "METRICS_ADDR": METRICS_ADDR,
    "RETENTION": RETENTION,
}


class Settings:
    """Attribute access to ``settings.DBWORKER`` merged over ``DEFAULTS``.

    Unknown keys are kept out of the attributes (the system check reports
    them) so that a typo never silently changes behaviour.
    """

    def __init__(self) -> None:
        self._cache: dict[str, Any] | None = None

    @property
    def user_settings(self) -> dict[str, Any]:
        value = getattr(django_settings, "DBWORKER", None)
        return value if isinstance(value, dict) else {}

    def _merged(self) -> dict[str, Any]:
        if self._cache is None:
            merged = dict(DEFAULTS)
            merged.update({k: v for k, v in self.user_settings.items() if k in DEFAULTS})
            self._cache = merged
        return self._cache

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in DEFAULTS:
            raise AttributeError(name)
        return self._merged()[name]

    def reset(self) -> None:
        self._cache = None


dbworker_settings = Settings()


@receiver(setting_changed)
def _reset_on_change(*, setting: str, **kwargs: Any) -> None:
    if setting == "DBWORKER":
        dbworker_settings.reset()
