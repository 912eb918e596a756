"""System checks for ``DBWORKER`` settings and the database configuration.

Ids are stable: E001-E009 for settings values (E009: Django's USE_TZ), E010-E014
for periodic handler declarations (the schedule, its time zone, its jitter),
E015-E017 for a ``DBWorkerBackend`` in ``TASKS`` (its own ``check()``, run by
Django's tasks checks), E018 for a database server too old to run the worker
(MySQL/MariaDB), E019 for a number of seconds no thread can wait for
(infinite, or above ``threading.TIMEOUT_MAX``), E020 for a handler's
``rate_limit`` that is not "N/s", "N/m" or "N/h", E021 for a bad
``concurrency_limit``, E022 for a database migrated by a development snapshot
short of its last migration, E023 for an async handler method that cannot
run (``atomic`` with ``async def handle``, an async generator, a periodic
handler's ``async def run``), E024 for a handler's bad ``fair_key``, W001-W009 for risky but
working configurations (W004: a MySQL binary log that is not row-based;
W005: a WAKEUP_DATABASE that is no PostgreSQL alias of DATABASES; W006:
work written to another database than the one transactions are opened on).
Checks read settings only and never connect, except the database checks
(``Tags.database``), which Django runs only when asked (``migrate``,
``check --database``). Each value is validated by ``validation.SETTINGS``, the
validators the ``run_workers`` flags and ``WorkerConfig`` use too.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import DEFAULT_DB_ALIAS, DatabaseError

from django_dbworker import validation
from django_dbworker.conf import DEFAULTS
from django_dbworker.db import server_problems, unfinished_development_migrations
from django_dbworker.handlers import Handler, WorkItemHandler
from django_dbworker.periodic.handler import PeriodicHandler, periodic_handlers
from django_dbworker.registry import registry
from django_dbworker.routing import NOT_ATOMIC_CHECK, work_db_for_write

#: Check ids of keys whose own id predates the shared validators; other keys
#: report E003 (wrong type) or E004 (out of range).
_KEY_IDS = {
    "MAX_ABANDONED_THREADS": "django_dbworker.E003",
    "METRICS_PORT": "django_dbworker.E005",
    "METRICS_ADDR": "django_dbworker.E006",
}


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    raw = getattr(settings, "DBWORKER", {})
    if not isinstance(raw, dict):
        return [
            Error(
                f"DBWORKER must be a dict, not {type(raw).__name__}.",
                hint="Set DBWORKER = {...} with the keys of the settings reference.",
                id="django_dbworker.E001",
            )
        ]
    errors: list[CheckMessage] = []
    for key in sorted(set(raw) - set(DEFAULTS)):
        errors.append(
            Error(
                f"DBWORKER has an unknown key {key!r}.",
                hint=f"Known keys: {', '.join(sorted(DEFAULTS))}.",
                id="django_dbworker.E002",
            )
        )
    for key, validator in validation.SETTINGS.items():
        if key not in raw:
            continue
        try:
            validator(raw[key])
        except validation.InvalidValue as exc:
            if exc.too_long:
                errors.append(
                    Error(
                        f"DBWORKER[{key!r}] {exc}.",
                        hint="A worker's threads wait this long; use a number of seconds "
                        "such as 1 or 60.",
                        id="django_dbworker.E019",
                    )
                )
                continue
            default_id = "django_dbworker.E003" if exc.wrong_type else "django_dbworker.E004"
            errors.append(Error(f"DBWORKER[{key!r}] {exc}.", id=_KEY_IDS.get(key, default_id)))
    if errors:
        return errors
    merged = {**DEFAULTS, **raw}
    if merged["STALE_AFTER"] < 2 * merged["HEARTBEAT_INTERVAL"]:
        errors.append(
            Error(
                f"DBWORKER['STALE_AFTER'] ({merged['STALE_AFTER']}) must be at least twice "
                f"HEARTBEAT_INTERVAL ({merged['HEARTBEAT_INTERVAL']}).",
                hint="Otherwise one late heartbeat makes a healthy job look crashed.",
                id="django_dbworker.E007",
            )
        )
    if merged["RETRY_BACKOFF_MAX"] < merged["RETRY_BACKOFF"]:
        errors.append(
            Error(
                "DBWORKER['RETRY_BACKOFF_MAX'] is smaller than RETRY_BACKOFF.",
                id="django_dbworker.E008",
            )
        )
    return errors


@register(Tags.compatibility)
def check_wakeup_database(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W005: WAKEUP_DATABASE names no alias of DATABASES, or one that is not PostgreSQL.

    A warning, not an error: the worker still runs, polling (its listener
    cannot connect, or has nothing to LISTEN on) and saying so in its log.
    """
    raw = getattr(settings, "DBWORKER", {})
    alias = raw.get("WAKEUP_DATABASE") if isinstance(raw, dict) else None
    if not isinstance(alias, str) or not alias:
        return []  # unset, or a bad value that check_settings reports
    databases = getattr(settings, "DATABASES", {})
    hint = (
        "Name an alias of DATABASES that connects to the work table's PostgreSQL database "
        "directly (not through a pooler in transaction mode), or remove the key: workers "
        "then LISTEN on the work table's own alias."
    )
    if alias not in databases:
        return [
            Warning(
                f"DBWORKER['WAKEUP_DATABASE'] is {alias!r}, which is not an alias of DATABASES "
                f"({', '.join(sorted(databases))}): wake-ups cannot reach the workers, "
                "which poll every POLL_INTERVAL.",
                hint=hint,
                id="django_dbworker.W005",
            )
        ]
    engine = str(databases[alias].get("ENGINE", ""))
    if "postgresql" not in engine and "postgis" not in engine:
        return [
            Warning(
                f"DBWORKER['WAKEUP_DATABASE'] is {alias!r}, whose ENGINE {engine!r} is not "
                "PostgreSQL: only PostgreSQL sends wake-ups (LISTEN/NOTIFY); the workers "
                "poll every POLL_INTERVAL.",
                hint=hint,
                id="django_dbworker.W005",
            )
        ]
    return []


@register(Tags.compatibility)
def check_time_zone_support(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Refuse USE_TZ = False: due times would be compared across time zones.

    Every due-time comparison uses the database clock (``CURRENT_TIMESTAMP``,
    UTC on SQLite). Without USE_TZ, Django stores a naive ``run_after`` as
    local time, so on a host east of UTC work due in two hours runs at once,
    and west of UTC it runs hours late.
    """
    if settings.USE_TZ:
        return []
    return [
        Error(
            "django_dbworker requires USE_TZ = True; it is False.",
            hint="Set USE_TZ = True. Due times are compared with the database's clock in "
            "UTC, and naive datetimes stored as local time would make work run early or late.",
            id="django_dbworker.E009",
        )
    ]


@register(Tags.compatibility)
def check_sqlite_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Warn when a SQLite database is configured in a way that makes workers fail.

    Workers write concurrently from several threads and processes. Without
    WAL, readers block writers; without a busy timeout, a write that meets a
    lock fails at once with "database is locked"; and with DEFERRED
    transactions a read that turns into a write cannot wait for the lock
    (see https://www.sqlite.org/lang_transaction.html and Django's notes on
    SQLite "transaction_mode").
    """
    return sqlite_warnings(settings.DATABASES)


def sqlite_warnings(databases: Mapping[str, Mapping[str, Any]]) -> list[CheckMessage]:
    warnings: list[CheckMessage] = []
    for alias, conf in databases.items():
        if not str(conf.get("ENGINE", "")).endswith("sqlite3"):
            continue
        options = conf.get("OPTIONS", {}) or {}
        init = str(options.get("init_command", "")).lower().replace(" ", "")
        if "journal_mode=wal" not in init:
            warnings.append(
                Warning(
                    f"SQLite database {alias!r} does not enable WAL mode.",
                    hint='Add OPTIONS["init_command"] = "PRAGMA journal_mode=WAL;" so '
                    "workers and web requests do not block each other.",
                    id="django_dbworker.W001",
                )
            )
        timeout = options.get("timeout", 5)  # Python's sqlite3 default
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 10:
            warnings.append(
                Warning(
                    f"SQLite database {alias!r} has a busy timeout of {timeout!r}s.",
                    hint='Set OPTIONS["timeout"] to 20 or more so concurrent writers wait '
                    'instead of failing with "database is locked".',
                    id="django_dbworker.W002",
                )
            )
        if str(options.get("transaction_mode", "DEFERRED")).upper() != "IMMEDIATE":
            warnings.append(
                Warning(
                    f"SQLite database {alias!r} uses DEFERRED transactions.",
                    hint='Set OPTIONS["transaction_mode"] = "IMMEDIATE" so transactions that '
                    "write wait for the lock instead of failing (atomic handlers, enqueue).",
                    id="django_dbworker.W003",
                )
            )
    return warnings


#: The database servers' problems (``VendorOperations.server_problems``) by
#: name: an error (the worker cannot run there) or a warning, and its id.
SERVER_CHECKS: dict[str, tuple[type[Error] | type[Warning], str]] = {
    "version": (Error, "django_dbworker.E018"),
    "replication": (Warning, "django_dbworker.W004"),
}


@register(Tags.database)
def check_database_servers(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """Refuse a server the worker cannot run on; warn about one it runs on at a risk.

    Each vendor says what is wrong with its server (MySQL before 8.0.1 and
    MariaDB before 10.6 lack ``SKIP LOCKED``: E018; their binary log must
    be row-based: W004; PostgreSQL and SQLite report nothing here). Only
    for the aliases Django asks about, since it connects.
    """
    messages: list[CheckMessage] = []
    for alias in databases or ():
        for problem in server_problems(alias):
            kind, check_id = SERVER_CHECKS[problem.check]
            messages.append(kind(problem.message, hint=problem.hint, id=check_id))
    return messages


@register(Tags.database)
def check_development_migrations(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """E022: a database migrated by a development snapshot that stopped short of the last
    development migration (``migrate`` would find nothing to do and the tables lack
    what 0.1 uses). Only for the aliases Django asks about, since it reads them."""
    messages: list[CheckMessage] = []
    for alias in databases or ():
        try:
            problem = unfinished_development_migrations(alias)
        except DatabaseError:
            continue  # unreachable: the command that connects says so
        if problem:
            messages.append(Error(problem, id="django_dbworker.E022"))
    return messages


#: Check ids of periodic declarations, by the attribute at fault.
PERIODIC_IDS = {
    "every_or_cron": "django_dbworker.E010",
    "cron": "django_dbworker.E011",
    "every": "django_dbworker.E012",
    "timezone": "django_dbworker.E013",
    "jitter": "django_dbworker.E014",
}

_PERIODIC_HINTS = {
    "every_or_cron": "Set `every = <seconds>` or `cron = '<minute> <hour> <day> <month> "
    "<weekday>'`, not both.",
    "cron": "Five fields: minute (0-59), hour (0-23), day of month (1-31), month (1-12 or "
    "JAN-DEC), day of week (0-7 or SUN-SAT); or one of @yearly, @annually, @monthly, "
    "@weekly, @daily, @midnight, @hourly.",
    "every": "`every` is a number of seconds, at least 1.",
    "timezone": "An IANA name from the tz database, such as 'Europe/Paris' or 'UTC'.",
    "jitter": "`jitter` is a number of seconds, 0 or more.",
}


@register(Tags.compatibility)
def check_periodic_handlers(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Refuse periodic handlers whose schedule cannot work, at start-up rather than at the slot."""
    return periodic_errors(registry.values())


def periodic_errors(classes: Any) -> list[CheckMessage]:
    """One error per problem of each periodic handler class among ``classes``."""
    errors: list[CheckMessage] = []
    for cls in periodic_handlers(classes):
        for problem in cls.declaration_problems():
            errors.append(
                Error(
                    f"Periodic handler {cls.name!r} ({cls.__module__}.{cls.__qualname__}) "
                    f"{problem}.",
                    hint=_PERIODIC_HINTS[problem.field],
                    obj=cls,
                    id=PERIODIC_IDS[problem.field],
                )
            )
    return errors


@register(Tags.compatibility)
def check_rate_limits(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Refuse a ``rate_limit`` the claim cannot keep ("0/s", "fast", "5/d", a number)."""
    return rate_limit_errors(registry.values())


def rate_limit_errors(classes: Any) -> list[CheckMessage]:
    """One error per WorkItem handler class among ``classes`` whose ``rate_limit`` is invalid."""
    errors: list[CheckMessage] = []
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, WorkItemHandler)):
            continue
        value = getattr(cls, "rate_limit", None)
        if value is None:
            continue
        try:
            validation.rate_limit(value)
        except validation.InvalidValue as exc:
            errors.append(
                Error(
                    f"Handler {cls.name!r} ({cls.__module__}.{cls.__qualname__}): "
                    f"rate_limit {exc}.",
                    hint='At most N starts per second, minute or hour: rate_limit = "50/s", '
                    '"100/m" or "1000/h", N at least 1 (None: no limit).',
                    obj=cls,
                    id="django_dbworker.E020",
                )
            )
    return errors


@register(Tags.compatibility)
def check_concurrency_limits(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Refuse a ``concurrency_limit`` that is not an integer of at least 1 (or None)."""
    return concurrency_limit_errors(registry.values())


def concurrency_limit_errors(classes: Any) -> list[CheckMessage]:
    """One error per WorkItem handler class among ``classes`` whose limit is bad."""
    errors: list[CheckMessage] = []
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, WorkItemHandler)):
            continue
        problem = validation.concurrency_limit_problem(cls.concurrency_limit)
        if problem is None:
            continue
        errors.append(
            Error(
                f"Handler {cls.name!r} ({cls.__module__}.{cls.__qualname__}) has a bad "
                f"concurrency_limit: {problem}.",
                hint="Set concurrency_limit to the number of items of one concurrency_key "
                "that may be claimed at once (1 or more), or None for no limit.",
                obj=cls,
                id="django_dbworker.E021",
            )
        )
    return errors


@register(Tags.compatibility)
def check_fair_keys(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Refuse a handler's ``fair_key`` that no enqueue would take (``fair_key_errors``)."""
    return fair_key_errors(registry.values())


def fair_key_errors(classes: Any) -> list[CheckMessage]:
    """One error per WorkItem handler class among ``classes`` whose declared fair key is
    bad: every enqueue of the handler (that gives no key of its own) would be refused."""
    errors: list[CheckMessage] = []
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, WorkItemHandler)):
            continue
        try:
            validation.fair_key(getattr(cls, "fair_key", None))
        except validation.InvalidValue as exc:
            errors.append(
                Error(
                    f"Handler {cls.name!r} ({cls.__module__}.{cls.__qualname__}) has a bad "
                    f"fair_key: it {exc}.",
                    hint="Set fair_key to a string of 1 to 200 characters, or None.",
                    obj=cls,
                    id="django_dbworker.E024",
                )
            )
    return errors


@register(Tags.compatibility)
def check_async_handlers(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Refuse async entry points that cannot run (``async_handler_errors``)."""
    return async_handler_errors(registry.values())


def async_handler_errors(classes: Any) -> list[CheckMessage]:
    """One error per WorkItem handler class among ``classes`` whose async entry point
    cannot run.

    ``async def handle`` (or ``handle_item``) runs on the worker's event
    loop, but not with ``atomic = True`` (a transaction is one thread's and
    cannot span the loop's awaits of many attempts), nor as an async
    generator (nothing would iterate it); a periodic handler's ``run`` is
    called by its plain ``handle`` and would never be awaited, nor would an
    own-table ``Handler[T]``'s ``claim``, ``process`` or ``recover_stale``.
    """
    errors: list[CheckMessage] = []
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, Handler)):
            continue
        label = f"Handler {cls.name!r} ({cls.__module__}.{cls.__qualname__})"
        if not issubclass(cls, WorkItemHandler):
            for method in ("claim", "process", "recover_stale"):
                entry = getattr(cls, method, None)
                if inspect.iscoroutinefunction(entry) or inspect.isasyncgenfunction(entry):
                    errors.append(
                        _e023(
                            cls,
                            f"{label} declares async def {method}: an own-table Handler[T] "
                            "runs on the worker's threads, which would never await it.",
                            f"Make {method} a plain def, or move the work to a "
                            "WorkItemHandler with async def handle (run on the event loop).",
                        )
                    )
            continue
        for method in ("handle", "handle_item"):
            entry = getattr(cls, method, None)
            if inspect.isasyncgenfunction(entry):
                errors.append(
                    _e023(
                        cls,
                        f"{label} declares {method} as an async generator (async def with "
                        "yield): the worker awaits it once and iterates nothing.",
                        "Return the result instead of yielding it.",
                    )
                )
            elif inspect.iscoroutinefunction(entry) and cls.atomic:
                errors.append(
                    _e023(
                        cls,
                        f"{label} declares async def {method} with atomic = True: a "
                        "transaction belongs to one thread and cannot span the awaits of "
                        "the worker's event loop.",
                        f"Set atomic = False, or make {method} a plain def (it then runs "
                        "on a worker thread, in the transaction).",
                    )
                )
        run = getattr(cls, "run", None)
        if issubclass(cls, PeriodicHandler) and (
            inspect.iscoroutinefunction(run) or inspect.isasyncgenfunction(run)
        ):
            errors.append(
                _e023(
                    cls,
                    f"{label} declares async def run: the periodic handler's plain handle "
                    "calls it and would store a coroutine that never ran.",
                    "Make run a plain def, or declare async def handle(self, payload) "
                    "instead of run (it runs on the worker's event loop).",
                )
            )
    return errors


def _e023(cls: type, msg: str, hint: str) -> Error:
    return Error(msg, hint=hint, obj=cls, id="django_dbworker.E023")


@register(Tags.compatibility)
def check_work_database(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Say that enqueue is not atomic with the project's transactions when the work is elsewhere.

    The routers write ``WorkItem`` to one alias; ``transaction.atomic()``
    opens on ``default``, and ``ATOMIC_REQUESTS`` on its own aliases. An
    enqueue on another alias than those commits at once, whatever becomes of
    the caller's transaction: a warning, silenced once that is intended
    (which silences the enqueue-time ``RuntimeWarning`` too). Reads settings
    and routers only.
    """
    return not_atomic_warnings(work_db_for_write(), getattr(settings, "DATABASES", {}))


def not_atomic_warnings(
    work: str, databases: Mapping[str, Mapping[str, Any]]
) -> list[CheckMessage]:
    """W006 for work written to ``work`` under these ``DATABASES``, if it applies."""
    atomic_requests = [alias for alias, conf in databases.items() if conf.get("ATOMIC_REQUESTS")]
    callers = sorted({DEFAULT_DB_ALIAS, *atomic_requests} - {work})
    if not callers:
        return []
    names = " and ".join(repr(alias) for alias in callers)
    requests = [alias for alias in callers if alias in atomic_requests]
    in_requests = (
        f" (and every request: ATOMIC_REQUESTS on {', '.join(map(repr, requests))})"
        if requests
        else ""
    )
    return [
        Warning(
            f"Work items are written to database {work!r} (the routers' "
            f"db_for_write(WorkItem)), not {names}: an enqueue inside transaction.atomic() "
            f"on {names}{in_requests} commits on {work!r} at once, whether or not that "
            "transaction commits; and an atomic handler's transaction, which records its "
            f"success, is on {work!r}: its writes to {names} are not exactly-once.",
            hint=(
                "To enqueue only once your data has committed: transaction.on_commit(lambda: "
                f"Handler.enqueue(...), using={callers[0]!r}). To make enqueues atomic together: "
                f"transaction.atomic(using={work!r}). If this is what you want, add "
                f"{NOT_ATOMIC_CHECK!r} to SILENCED_SYSTEM_CHECKS (this also silences the "
                "RuntimeWarning of an enqueue inside a transaction on another database)."
            ),
            id=NOT_ATOMIC_CHECK,
        )
    ]
