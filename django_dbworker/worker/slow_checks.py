"""Watchers: slow background looks that ``run_workers`` asks a worker to keep up.

Two today: the repeated warning about pending rows that no handler here
runs (``OrphanWatch``), and the discovery of ``@task`` functions first
enqueued after start-up (``TaskDiscovery``). The worker starts them with
its other helper threads and its watchdog sees them: each ends by itself
when the worker stops claiming. A look that fails (whatever it raises) is
logged, its connection closed, and tried again at the next interval; it
never stops the worker.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from django.db import DatabaseError

from django_dbworker.discovery import import_by_path, new_pending_handlers
from django_dbworker.handlers import WorkItemHandler
from django_dbworker.registry import registry
from django_dbworker.stats import orphaned_handlers
from django_dbworker.worker.connections import close_quietly, close_thread_connections

logger = logging.getLogger("django_dbworker.worker")

#: Seconds between the repeated warnings about pending rows nothing runs.
ORPHAN_CHECK_INTERVAL = 600.0
#: Seconds between looks for pending rows of tasks this worker has not imported.
TASK_DISCOVERY_INTERVAL = 5.0

#: What a watcher may hand the worker: handler classes to claim for too.
AddHandlers = Callable[[Sequence[type[WorkItemHandler]]], None]


class Watcher(threading.Thread):
    """Calls ``look()`` every ``interval`` seconds until the worker stops claiming."""

    what = "watcher"

    def __init__(self, using: str, *, interval: float) -> None:
        super().__init__(name=f"dbworker-{self.what.replace(' ', '-')}", daemon=True)
        self.using = using
        self.interval = interval
        self._stopping = threading.Event()
        self._add_handlers: AddHandlers | None = None

    def attach(self, *, stopping: threading.Event, add_handlers: AddHandlers) -> None:
        """Bind to the worker that starts it (before ``start``)."""
        self._stopping = stopping
        self._add_handlers = add_handlers

    def run(self) -> None:
        try:
            self.begin()
            while not self._stopping.wait(self.interval):
                try:
                    self.look()
                except Exception as exc:
                    # A look is best effort: the database may be away (its
                    # connection is closed, so the next look reconnects; the
                    # claim loop reports the outage), an imported module may
                    # fail; the worker goes on either way.
                    level = logging.DEBUG if isinstance(exc, DatabaseError) else logging.WARNING
                    logger.log(level, "%s: a look failed (%s); trying again later.", self.what, exc)
                    close_quietly(self.using)
        finally:
            close_thread_connections()

    def begin(self) -> None:
        """Once, when the thread starts."""

    def look(self) -> None:
        raise NotImplementedError


def warn_about_orphans(using: str) -> None:
    """Pending rows that no handler of this deployment runs would wait forever, silently."""
    try:
        orphans = orphaned_handlers(using)
    except DatabaseError:
        # The claim loop will say what is wrong with the database; a broken
        # connection is closed so that the next look reconnects.
        close_quietly(using)
        return
    for orphan in orphans:
        logger.warning(
            "%d pending item(s) of handler %r wait for a handler nothing here registers "
            "(oldest: %.0fs). Is it defined in a `workers.py` module of an installed app, "
            "under that name?",
            orphan["pending"],
            orphan["handler"],
            orphan["oldest_age"],
        )


class OrphanWatch(Watcher):
    """Repeats the orphan warning every ``interval`` seconds.

    Rows enqueued after start-up under a name nothing registers (a deploy of
    the web tier ahead of the workers, a handler moved out of ``workers.py``)
    would otherwise wait without a sign until the next restart.
    """

    what = "orphan watch"

    def __init__(self, using: str, *, interval: float = ORPHAN_CHECK_INTERVAL) -> None:
        super().__init__(using, interval=interval)

    def look(self) -> None:
        warn_about_orphans(self.using)


class TaskDiscovery(Watcher):
    """Runs ``@task`` functions enqueued after start-up from modules not imported yet.

    Django lets a task live in any module (``myapp/emails.py``); a worker
    imports the ``tasks`` modules at start, and the modules of the rows
    pending then, but a task first enqueued later would wait for the next
    restart. Every ``interval`` seconds this looks at the rows added since
    the last look (a primary-key range, however large the table), imports
    the project's modules their handler names point to, and adds the tasks
    found to the running worker.
    """

    what = "task discovery"

    def __init__(self, using: str, *, interval: float = TASK_DISCOVERY_INTERVAL) -> None:
        super().__init__(using, interval=interval)
        self._seen: int | None = None

    def begin(self) -> None:
        # The baseline now, not after the first interval: a row added
        # meanwhile is then found at the first look, not the second.
        try:
            _, self._seen = new_pending_handlers(None, self.using)
        except Exception:
            close_quietly(self.using)  # the first look takes the baseline instead

    def look(self) -> None:
        names, self._seen = new_pending_handlers(self._seen, self.using)
        found = import_by_path(names)
        classes = [c for n in found if issubclass(c := registry[n], WorkItemHandler)]
        if classes and self._add_handlers is not None:
            self._add_handlers(classes)
            logger.info("Now running task(s) enqueued since start: %s", ", ".join(found))
