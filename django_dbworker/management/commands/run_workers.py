"""``manage.py run_workers``: parse and validate flags, build a ``Worker``, run it."""

from __future__ import annotations

import gc
import logging
import pkgutil
import queue
import signal
import sys
import threading
from argparse import ArgumentParser, ArgumentTypeError
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, TypeVar

from django.apps import apps
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, SystemCheckError
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.recorder import MigrationRecorder
from django.utils import timezone

from django_dbworker import metrics, validation
from django_dbworker.db import (
    UnsupportedDatabase,
    migrate_command,
    operations,
    setup_problem,
    unfinished_development_migrations,
)
from django_dbworker.discovery import autodiscover, import_by_path, uses_task_backend
from django_dbworker.handlers import unimplemented
from django_dbworker.management import reloading
from django_dbworker.outcomes import Outcome
from django_dbworker.periodic.handler import periodic_handlers
from django_dbworker.registry import registry
from django_dbworker.routing import work_db_for_write
from django_dbworker.stats import orphaned_handlers
from django_dbworker.worker.runtime import Worker, WorkerConfig
from django_dbworker.worker.slow_checks import (
    OrphanWatch,
    TaskDiscovery,
    Watcher,
    warn_about_orphans,
)

logger = logging.getLogger("django_dbworker")

#: Exit status when the worker stopped itself because it could not keep its
#: promises (a helper thread died, too many abandoned handler threads).
EXIT_UNHEALTHY = 3

V = TypeVar("V")


def _flag(parse: Callable[[str], Any], validator: Callable[[Any], V]) -> Callable[[str], V]:
    """An argparse ``type``: parse the text, then the shared validator."""
    kind = "an integer" if parse is int else "a number"

    def convert(text: str) -> V:
        try:
            value = parse(text)
        except ValueError:
            raise ArgumentTypeError(f"{text!r} is not {kind}") from None
        try:
            return validator(value)
        except validation.InvalidValue as exc:
            raise ArgumentTypeError(str(exc)) from None

    convert.__name__ = validator.__name__  # argparse names the type in its messages
    return convert


_positive_int = _flag(int, validation.positive_int)
_wait_seconds = _flag(float, validation.timeout_seconds)
_wait_or_zero_seconds = _flag(float, validation.wait_or_zero_seconds)
_port = _flag(int, validation.port)
_queue = _flag(str, validation.queue_name)


class Command(BaseCommand):
    help = "Run background workers for the registered handlers until stopped."
    # Checks run once below with a clearer context; skip Django's implicit run.
    requires_system_checks: list[str] = []

    def run_from_argv(self, argv: list[str]) -> None:
        """``manage.py run_workers``: the process ends when this returns.

        Freezing the collector's objects first spares the interpreter's
        teardown a walk over every object Django and the app made: 80 ms of
        each exit, more than a ``--burst`` run of one job spends on the job.
        Exit handlers (logging, a tracing SDK's flush) still run; only
        cyclic garbage is left to the operating system. Not done for
        ``call_command``, whose caller goes on.
        """
        try:
            super().run_from_argv(argv)
        finally:
            gc.freeze()

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "names",
            nargs="*",
            metavar="NAME",
            help="Handler names to run (default: all registered).",
        )
        parser.add_argument(
            "--queue",
            action="append",
            type=_queue,
            dest="queues",
            metavar="Q",
            help="Only WorkItems of this queue (repeatable; default: all).",
        )
        parser.add_argument(
            "--concurrency",
            type=_positive_int,
            help="Worker threads (default: DBWORKER['CONCURRENCY']).",
        )
        parser.add_argument(
            "--async-concurrency",
            type=_positive_int,
            metavar="N",
            help="Items of async handlers running at once on the worker's event loop "
            "(default: DBWORKER['ASYNC_CONCURRENCY']).",
        )
        parser.add_argument(
            "--interval",
            type=_wait_seconds,
            metavar="SECONDS",
            help="Idle poll interval (default: DBWORKER['POLL_INTERVAL']).",
        )
        # A burst run ends by itself; a reloading one runs until stopped.
        once_or_reload = parser.add_mutually_exclusive_group()
        once_or_reload.add_argument(
            "--burst",
            action="store_true",
            help="Exit 0 once nothing is claimable and nothing runs.",
        )
        once_or_reload.add_argument(
            "--reload",
            action="store_true",
            help="For development: restart the worker (after a drain) when a Python file "
            "of the project changes, as runserver does.",
        )
        parser.add_argument(
            "--metrics-port",
            type=_port,
            metavar="PORT",
            help="Serve Prometheus /metrics on this port.",
        )
        parser.add_argument(
            "--metrics-addr", metavar="ADDR", help="Address for /metrics (default: 127.0.0.1)."
        )
        parser.add_argument(
            "--shutdown-timeout",
            type=_wait_or_zero_seconds,
            metavar="SECONDS",
            help="Drain time on SIGTERM (default: DBWORKER['SHUTDOWN_TIMEOUT']).",
        )
        parser.add_argument(
            "--health-file",
            metavar="PATH",
            help="Keep this file fresh while the worker is healthy; probe it with "
            "`manage.py dbworker_health --file PATH`.",
        )
        parser.add_argument(
            "--database",
            help="Database alias holding the work (default: the routers' "
            "db_for_write(WorkItem), 'default' without routers).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        _ensure_log_output(options["verbosity"])
        if options["reload"] and not reloading.in_child():
            # This process only restarts the one that works: no checks, no connection.
            sys.exit(reloading.supervise())
        using = work_db_for_write(options["database"])
        # The checks of the code, not of the databases (``_check_database`` asks the work
        # database what the worker needs): Django 6.1 runs the model checks against every
        # alias by default, which connects (JSONField asks SQLite for JSON: a traceback for a
        # file in a missing folder) and repeats at every start the warnings about
        # django-dbworker's conditional indexes on MySQL (W036/W037, which its own MySQL
        # migration answers). ``manage.py check --database`` still shows them.
        try:
            self.check(display_num_errors=False, databases=[])
        except SystemCheckError as exc:
            # A configuration mistake, not an outage that passes: the usage exit status,
            # which the process managers' recipes do not restart (deploy/).
            exc.returncode = 2
            raise
        autodiscover()
        # Django tasks may live in any module: import those that named
        # handlers (on the command line, or of pending rows) point to.
        import_by_path(options["names"] or [])
        if not options["names"]:
            self._import_pending_tasks(using)
        names: list[str] = options["names"] or sorted(registry)
        unknown = [n for n in names if n not in registry]
        if unknown:
            known = ", ".join(sorted(registry)) or "(none: add a workers.py to an installed app)"
            raise CommandError(
                f"Unknown handler name(s): {', '.join(unknown)}. Registered handlers: {known}.",
                returncode=2,
            )
        if not names:
            raise CommandError(
                "No handlers are registered. Define WorkItemHandler or Handler subclasses in a "
                "`workers.py` module of an installed app.",
                returncode=2,
            )
        incomplete = {name: unimplemented(registry[name]) for name in names}
        for name, methods in incomplete.items():
            if methods:
                cls = registry[name]
                raise CommandError(
                    f"Handler {name!r} ({cls.__module__}.{cls.__qualname__}) does not implement "
                    f"{' and '.join(f'{m}()' for m in methods)}: an own-table Handler[T] claims "
                    "its items itself (raising NoTask when there are none) and processes them.",
                    returncode=2,
                )
        self._check_database(using)

        flags = {
            "concurrency": options["concurrency"],
            "async_concurrency": options["async_concurrency"],
            "poll_interval": options["interval"],
            "shutdown_timeout": options["shutdown_timeout"],
        }
        config = WorkerConfig(
            using=using,
            burst=options["burst"],
            queues=options["queues"],
            health_file=options["health_file"],
            **{field: value for field, value in flags.items() if value is not None},
        )
        watchers: list[Watcher] = [OrphanWatch(using)]
        if not options["names"] and uses_task_backend():
            watchers.append(TaskDiscovery(using))
        worker = Worker([registry[n] for n in names], config, watchers=watchers)
        # Before the start-up line, which supervisors and scripts wait for: a
        # stop signal from then on is a clean stop.
        signals = self._install_signal_handlers(worker, reload=options["reload"])
        logger.info(
            "Starting worker: handlers=%s queues=%s concurrency=%d database=%s%s%s%s",
            ",".join(names),
            ",".join(config.queues) if config.queues else "all",
            config.concurrency,
            operations(using).vendor,
            # The alias too where the work is not on default (a queue database).
            "" if using == DEFAULT_DB_ALIAS else f" alias={using}",
            " (burst)" if config.burst else "",
            " (reload)" if options["reload"] else "",
        )
        _log_schedules([registry[n] for n in names], config.queues)
        warn_about_orphans(using)
        self._start_metrics_server(options)
        changed = False
        try:
            if options["reload"]:
                changed = reloading.run_in_child(worker, signals)
            else:
                worker.run()
        finally:
            signals.close()
            metrics.mark_process_dead()
        if config.burst and not signals.count and worker.unhealthy is None:
            # The expected end of a burst run: a summary, not a shutdown notice.
            logger.info(
                "Burst done, the queue is drained (nothing left to claim for handlers=%s, "
                "queues=%s). Worker stopped: %s.",
                ",".join(names),
                ",".join(config.queues) if config.queues else "all",
                _summary(worker),
            )
        else:
            logger.info("Worker stopped: %s.", _summary(worker))
        if changed:
            sys.exit(reloading.RESTART)
        if worker.unhealthy is not None:
            # Non-zero, so that systemd, Kubernetes or supervisord start a fresh process
            # (under --reload: the same status, so its parent starts a fresh child).
            raise CommandError(
                f"Worker stopped itself: {worker.unhealthy}.", returncode=EXIT_UNHEALTHY
            )

    def _check_database(self, using: str) -> None:
        try:
            ops = operations(using)
            ops.check_version()
        except UnsupportedDatabase as exc:
            raise CommandError(str(exc)) from None
        except DatabaseError as exc:
            raise CommandError(_unreachable(using, exc)) from None
        try:
            pending = _pending_migrations(connections[using])
        except Exception as exc:
            raise CommandError(_unreachable(using, exc)) from None
        if pending:
            raise CommandError(
                f"django_dbworker migrations are not applied to database {using!r} "
                f"({pending} pending). Run `{migrate_command(using)}` first."
            )
        unfinished = unfinished_development_migrations(using)
        if unfinished:
            raise CommandError(unfinished, returncode=2)  # a restart will not help

    def _start_metrics_server(self, options: dict[str, Any]) -> None:
        from django_dbworker.conf import dbworker_settings

        if apps.is_installed("django_dbworker.contrib.prometheus"):
            # Queue gauges belong to the web process's /metrics: every worker
            # would report the same global numbers (and query for them).
            from django_dbworker.contrib.prometheus.collector import unregister

            unregister()
        port = options["metrics_port"] or dbworker_settings.METRICS_PORT
        if not port:
            return
        addr = options["metrics_addr"] or dbworker_settings.METRICS_ADDR
        try:
            metrics.serve(int(port), addr)
        except RuntimeError as exc:
            raise CommandError(str(exc)) from None
        except OSError as exc:
            raise CommandError(f"Cannot serve metrics on {addr}:{port}: {exc}") from None
        logger.info("Serving Prometheus metrics on http://%s:%s/metrics", addr, port)

    def _import_pending_tasks(self, using: str) -> None:
        """Import the handlers of pending rows that are import paths (``@task`` functions).

        Best effort before the database check: if the work table cannot be
        read yet, ``_check_database`` says why, clearly.
        """
        try:
            pending = [row["handler"] for row in orphaned_handlers(using)]
        except DatabaseError:
            return
        found = import_by_path(pending)
        if found:
            logger.info("Imported task module(s) for pending rows: %s", ", ".join(found))

    def _install_signal_handlers(self, worker: Worker, *, reload: bool = False) -> _StopOnSignal:
        """SIGTERM and SIGINT stop ``worker`` (``_StopOnSignal``).

        Under ``--reload`` only SIGTERM: the parent forwards SIGINT as SIGTERM
        and started this child with SIGINT ignored (``reloading.supervise``).
        """
        if reload:
            return _StopOnSignal(worker, (signal.SIGTERM,))
        return _StopOnSignal(worker, (signal.SIGTERM, signal.SIGINT))


class _StopOnSignal:
    """Stop signals (``signums``) stop a worker: the first drains it, the next releases at once.

    The handlers only hand the signal over, with ``SimpleQueue.put`` (reentrant
    C code that takes no lock of Python's), to a thread that logs it and stops
    the worker. Python runs a signal handler on the main thread between two
    bytecodes of whatever that thread is doing, another handler included: a
    handler that takes a lock (``Event.set`` takes its condition's, a logging
    handler its own) waits forever when the code it interrupted holds it. A
    second signal that came while the first one's handler was inside
    ``stopping.set()`` hung the worker that way, before its drain. On a
    thread of its own, a stop waits for such a lock only until the main
    thread lets go of it.
    """

    def __init__(self, worker: Worker, signums: Sequence[int]) -> None:
        self.worker = worker
        self.signums = signums
        #: Stop signals handled so far.
        self.count = 0
        self._arrived: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="dbworker-signals", daemon=True)
        self._thread.start()
        self.listen()

    def listen(self) -> None:
        """Handle the stop signals here (again, after Django's autoreloader took SIGTERM)."""
        for signum in self.signums:
            signal.signal(signum, self._on_signal)

    def handle(self, signum: int) -> None:
        """A stop signal another handler took (Django's autoreloader's), as if it came now."""
        self._arrived.put(signum)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.handle(signum)

    def _serve(self) -> None:
        while (signum := self._arrived.get()) is not None:
            self.count += 1
            name = signal.Signals(signum).name
            if self.count == 1:
                logger.info(
                    "%s received: finishing running items, then stopping "
                    "(send again to stop at once).",
                    name,
                )
                self.worker.stop()
            else:
                logger.warning("%s received again: releasing running items and stopping now.", name)
                self.worker.stop(immediate=True)

    def close(self) -> None:
        """End the thread (the worker has stopped): after the signals already handed over."""
        self._arrived.put(None)


def _unreachable(using: str, exc: BaseException) -> str:
    """One line: which database, where, what the driver said, what to check."""
    problem = setup_problem(using, exc)
    if problem is not None:
        return problem
    conf = connections[using].settings_dict
    where = (
        f"{conf.get('HOST') or 'localhost'}:{conf.get('PORT') or 'default port'}"
        if conf.get("HOST") or conf.get("PORT")
        else str(conf.get("NAME"))
    )
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"Cannot reach the database {using!r} at {where}: {said}. Check that the server is "
        f"running and DATABASES[{using!r}] (HOST, PORT, NAME, USER, PASSWORD)."
    )


def _summary(worker: Worker) -> str:
    """``3 succeeded, 1 failed, 0 retried, 0 released`` (+ snoozed, cancelled, timeouts and
    fenced if any)."""
    counts = worker.outcomes
    parts = [
        f"{counts[Outcome.SUCCEEDED]} succeeded",
        f"{counts[Outcome.FAILED]} failed",
        f"{counts[Outcome.RETRIED]} retried",
        f"{worker.released} released",
    ]
    for outcome in (Outcome.SNOOZED, Outcome.CANCELLED):
        if counts[outcome]:
            parts.append(f"{counts[outcome]} {outcome}")
    if counts[Outcome.TIMEOUT]:
        parts.append(f"{counts[Outcome.TIMEOUT]} timed out")
    if counts[Outcome.FENCED]:
        parts.append(f"{counts[Outcome.FENCED]} discarded (fenced)")
    return ", ".join(parts)


def _log_schedules(handlers: list[type[Any]], queues: Sequence[str] | None) -> None:
    """One line per periodic handler: its schedule in words and its next slot."""
    now = timezone.now()
    for cls in periodic_handlers(handlers):
        schedule = cls.get_schedule()
        following = schedule.following(now)
        if queues and cls.queue not in queues:
            logger.info(
                "Schedule %s: %s; not enqueued by this worker (its queue %r is not one of "
                "--queue %s).",
                cls.name,
                schedule.describe(),
                cls.queue,
                ",".join(queues),
            )
            continue
        logger.info(
            "Schedule %s: %s, queue %s; next slot %s.",
            cls.name,
            schedule.describe(),
            cls.queue,
            "none" if following is None else following.isoformat(timespec="seconds"),
        )


def _ensure_log_output(verbosity: int) -> None:
    """Show the worker's log lines when the project has not configured logging for them.

    ``-v 2`` asks for one line per item on the command line: it lowers the
    ``django_dbworker`` logger to DEBUG even where the project set a level.
    """
    pkg = logging.getLogger("django_dbworker")
    if verbosity > 1:
        pkg.setLevel(logging.DEBUG)
    if pkg.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    pkg.addHandler(handler)
    pkg.setLevel(logging.DEBUG if verbosity > 1 else logging.INFO)


def _pending_migrations(connection: Any) -> int:
    """How many of django_dbworker's migrations ``connection``'s database has not applied.

    The shipped migration files against one read of ``django_migrations``:
    building the migration graph instead (every installed app's migrations
    imported and linked) took about a tenth of the worker's start, for the
    same answer. A project that moved the app's migrations elsewhere
    (``MIGRATION_MODULES``) gets the graph.
    """
    if "django_dbworker" in settings.MIGRATION_MODULES:
        executor = MigrationExecutor(connection)
        targets = [key for key in executor.loader.graph.leaf_nodes() if key[0] == "django_dbworker"]
        return len(executor.migration_plan(targets))
    from django_dbworker import migrations

    shipped = {m.name for m in pkgutil.iter_modules(migrations.__path__) if m.name[:4].isdigit()}
    recorder = MigrationRecorder(connection)
    if not recorder.has_table():
        return len(shipped)
    applied = recorder.migration_qs.filter(app="django_dbworker").values_list("name", flat=True)
    return len(shipped - set(applied))
