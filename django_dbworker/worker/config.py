"""``WorkerConfig``: what a worker is told, with defaults from ``DBWORKER`` settings.

Validated once, when built, by the same validators as the system checks
and ``run_workers``' flags (``validation.py``). Holds no behaviour.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from django_dbworker import validation
from django_dbworker.conf import dbworker_settings
from django_dbworker.routing import work_db_for_write

#: Finished rows whose success write may still be pending, beyond the rows
#: running and buffered.
UNRECORDED_EXTRA = 100
#: Most rows one claim statement takes.
MAX_CLAIM = 500
#: Seconds between a buffering worker's looks for ready rows that outrank its buffer, where
#: wake-ups do not say their priority (SQLite, MySQL/MariaDB, a pooler without
#: WAKEUP_DATABASE): an urgent item waits for the running items and about this much
#: buffered work, not for the whole buffer (PREFETCH_HORIZON).
URGENT_PEEK = 0.05
#: A buffered row that waited this many horizons (and at least a second)
#: makes the worker reconsider what it holds.
SHED_AFTER_HORIZONS = 2.0
#: Seconds past SHUTDOWN_TIMEOUT a stopping worker waits for the outcomes of
#: finished handlers to be written (while the database is briefly away).
RECORD_GRACE = 30.0
#: Seconds a cancelled async handler's coroutine (a timeout, a cancel request, a
#: stop) gets to end before its attempt is recorded (or released) without it.
CANCEL_GRACE = 5.0
#: How long a stopping worker waits for handlers' attempt_recorded hooks
#: (task_finished receivers) still queued.
HOOK_GRACE = 10.0


@dataclass
class WorkerConfig:
    """Everything a ``Worker`` needs; defaults come from ``DBWORKER`` settings."""

    concurrency: int = field(default_factory=lambda: int(dbworker_settings.CONCURRENCY))
    #: Async handlers' items running at once on the worker's event loop (``event_loop.py``).
    async_concurrency: int = field(default_factory=lambda: int(dbworker_settings.ASYNC_CONCURRENCY))
    poll_interval: float = field(default_factory=lambda: float(dbworker_settings.POLL_INTERVAL))
    #: LISTEN for other processes' wake-ups (WAKEUPS); False: poll only.
    wakeups: bool = field(default_factory=lambda: bool(dbworker_settings.WAKEUPS))
    #: Seconds after each wake-up at which the worker claims once more
    #: (WAKEUP_WINDOW): enqueuers skip wake-ups within that window.
    wakeup_window: float = field(default_factory=lambda: float(dbworker_settings.WAKEUP_WINDOW))
    #: The alias whose connection the worker LISTENs on (WAKEUP_DATABASE);
    #: None: ``using``. See ``listen_using``.
    wakeup_database: str | None = field(default_factory=lambda: dbworker_settings.WAKEUP_DATABASE)
    batch_size: int = field(default_factory=lambda: int(dbworker_settings.BATCH_SIZE))
    heartbeat_interval: float = field(
        default_factory=lambda: float(dbworker_settings.HEARTBEAT_INTERVAL)
    )
    stale_after: float = field(default_factory=lambda: float(dbworker_settings.STALE_AFTER))
    shutdown_timeout: float = field(
        default_factory=lambda: float(dbworker_settings.SHUTDOWN_TIMEOUT)
    )
    #: Timed-out handler threads still running at which the process stops
    #: claiming and exits non-zero; None means ``concurrency``.
    max_abandoned_threads: int | None = field(
        default_factory=lambda: dbworker_settings.MAX_ABANDONED_THREADS
    )
    burst: bool = False
    queues: Sequence[str] | None = None
    #: The database alias of the work table (routing.py: the routers' write alias).
    using: str = field(default_factory=work_db_for_write)
    #: Run each item in the calling thread, one at a time: no pool, writer,
    #: heartbeat or wake-up threads, and no timeouts (they need a second
    #: thread, which would not see the caller's transaction). What
    #: ``testing.run_until_empty`` uses, so tests run the production path.
    #: Read once, by the factory that builds the worker's parts (``parts.py``).
    inline: bool = False
    #: Claim at most this many items, then stop (None: no limit).
    max_items: int | None = None
    #: Seconds of work to hold claimed beyond the running items (0: claim
    #: only for free threads); see ``prefetch.py``. Inline, nothing is held.
    prefetch_horizon: float = field(
        default_factory=lambda: float(dbworker_settings.PREFETCH_HORIZON)
    )
    #: Keep this file fresh while healthy (``health.py``); None: no file.
    health_file: str | None = None

    def __post_init__(self) -> None:
        # The same validators as the system checks and run_workers' flags.
        validation.validate_worker_config(self)

    @property
    def listen_using(self) -> str:
        """The alias the wake-up listener connects with: WAKEUP_DATABASE, else ``using``."""
        return self.wakeup_database or self.using

    @property
    def abandoned_cap(self) -> int:
        """Abandoned threads at which the watchdog stops the process."""
        return self.max_abandoned_threads or self.concurrency
