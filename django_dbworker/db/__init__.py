"""Database-vendor operations: the only package that knows PostgreSQL from SQLite from MySQL.

Everything vendor-specific (the claim and success statements, inserts with
wake-ups, LISTEN, planner estimates, SKIP LOCKED support, supported
versions) sits behind ``VendorOperations``; the rest of the code asks
``operations(using)`` and never checks ``connection.vendor`` or
``connection.features`` itself, nor writes SQL. Each vendor has a queries
file of named statements (``postgresql_sql.py``, ``mysql_sql.py``; the top
of the short ``sqlite.py``) and an operations class that runs them (see
tests/conformance/snapshots/ for every statement as it runs). ``base.py``
holds the interface, ``types.py`` the values it speaks in, ``sql.py`` the
``Statement`` type, ``wakers.py`` this process's wake-ups, ``flow.py`` the
flow-controlled claims every vendor shares (rate limits).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dbworker.db.base import VendorOperations
from django_dbworker.db.errors import is_missing_table
from django_dbworker.db.types import ServerProblem, Subscription, UnsupportedDatabase
from django_dbworker.db.wakers import (
    add_local_waker,
    parse_wake_payload,
    remove_local_waker,
    wake_payload,
)
from django_dbworker.routing import work_db_for_write

__all__ = [
    "ServerProblem",
    "Subscription",
    "UnsupportedDatabase",
    "VendorOperations",
    "add_local_waker",
    "operations",
    "parse_wake_payload",
    "prepare_session",
    "remove_local_waker",
    "server_problems",
    "setup_problem",
    "skip_locked_options",
    "supports_skip_locked",
    "unfinished_development_migrations",
    "wake_payload",
]


_instances: dict[tuple[str, str], VendorOperations] = {}


def _operations_class(vendor: str) -> type[VendorOperations] | None:
    """The operations class of Django's ``connection.vendor``; None for a vendor we lack.

    Each vendor module is imported on first use: only the drivers a
    project's databases use are ever imported.
    """
    if vendor == "postgresql":
        from django_dbworker.db.postgresql import PostgresOperations

        return PostgresOperations
    if vendor == "sqlite":
        from django_dbworker.db.sqlite import SQLiteOperations

        return SQLiteOperations
    if vendor == "mysql":
        from django_dbworker.db.mysql import MySQLOperations

        return MySQLOperations
    return None


def operations(using: str | None = None) -> VendorOperations:
    """The vendor operations for the database alias ``using``.

    One instance per alias and vendor, shared by all threads: it holds only
    a cache of Django's column converters (connections are looked up per
    thread on each use). Without ``using``: the alias the routers write the
    work table to, as its querysets without one do.
    """
    alias = work_db_for_write(using)
    vendor = connections[alias].vendor
    ops = _instances.get((alias, vendor))
    if ops is not None:
        return ops
    cls = _operations_class(vendor)
    if cls is None:
        raise UnsupportedDatabase(
            f"django-dbworker does not support the {vendor!r} database backend yet "
            "(supported: PostgreSQL 13+, SQLite 3.35+, MySQL 8.0.1+, MariaDB 10.6+)."
        )
    ops = _instances[(alias, vendor)] = cls(alias)
    return ops


def prepare_session(sender: Any, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
    """``connection_created`` receiver: the connection's vendor sets up the new session.

    MySQL pins the session's time zone to UTC; the other vendors need
    nothing, and a database of a vendor django-dbworker does not support is
    left alone (it may hold only the project's other tables).
    """
    cls = _operations_class(connection.vendor)
    if cls is not None:
        cls.prepare_session(connection)


def server_problems(using: str) -> list[ServerProblem]:
    """What is wrong with the server of the alias ``using`` for django-dbworker; connects.

    Nothing for a database of a vendor django-dbworker does not support
    (it may hold only the project's other tables).
    """
    try:
        ops = operations(using)
    except UnsupportedDatabase:
        return []
    return ops.server_problems()


def migrate_command(using: str) -> str:
    """The command that migrates the work tables on ``using`` (one alias at a time)."""
    if using == DEFAULT_DB_ALIAS:
        return "manage.py migrate"
    return f"manage.py migrate --database {using}"


#: The development migrations that 0.1's ``0001_initial`` replaces (it builds the same
#: schema: tests/integration/test_migrations.py). A database that recorded some of them
#: but not the last has ``0001_initial`` recorded, so Django would count it as migrated.
DEVELOPMENT_MIGRATIONS = (
    "0002_periodic_schedule",
    "0003_workitem_dbworker_finished_idx",
    "0004_workitem_error_history",
    "0005_mysql_support",
    "0006_flow_control",
    "0007_batches_and_dependencies",
    "0008_key_heads",
    "0009_flow_names_binary",
    "0010_worker_register",
    "0011_drop_worker_register",
    "0012_rate_start_buckets",
)


def unfinished_development_migrations(using: str) -> str | None:
    """Why ``using``'s database cannot be used as migrated, or None; reads one table.

    A database migrated by a development snapshot before 0.1 that stopped short of
    the last development migration lacks columns and tables that 0.1 uses, while
    ``migrate`` finds nothing to do (``0001_initial`` is recorded)."""
    from django.db.migrations.recorder import MigrationRecorder

    recorder = MigrationRecorder(connections[using])
    if not recorder.has_table():
        return None
    applied = set(
        recorder.migration_qs.filter(app="django_dbworker").values_list("name", flat=True)
    )
    reached = sorted(applied.intersection(DEVELOPMENT_MIGRATIONS))
    if not reached or DEVELOPMENT_MIGRATIONS[-1] in applied:
        return None
    return (
        f"Database {using!r} was migrated by a development snapshot of django-dbworker, up "
        f"to {reached[-1]}; 0.1 replaces those migrations with one and needs all of them "
        f"applied first. Install the last snapshot that has "
        f"{DEVELOPMENT_MIGRATIONS[-1]}.py, run `{migrate_command(using)}`, then install "
        f"this version (docs/upgrading.md, '0.1.0: from a development snapshot')."
    )


def setup_problem(using: str, exc: BaseException) -> str | None:
    """What a first-day mistake behind ``exc`` is, and its fix, in one sentence; or None.

    The work table does not exist (``migrate`` has not run on ``using``), or
    the alias is a SQLite file whose folder does not exist (SQLite says only
    "unable to open database file"). Anything else is the database's own
    error, for the caller to report as it is.
    """
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if is_missing_table(exc):
        return (
            f"The django_dbworker tables do not exist in database {using!r} ({said}): "
            f"run `{migrate_command(using)}` first."
        )
    conn = connections[using]
    name = str(conn.settings_dict.get("NAME") or "")
    if conn.vendor == "sqlite" and name and not name.startswith("file:") and name != ":memory:":
        folder = Path(name).parent
        if not folder.is_dir():
            return (
                f"Cannot open the SQLite database {using!r} ({said}): the folder {folder} "
                f"does not exist. Create it, or set DATABASES[{using!r}]['NAME'] to a file "
                "in an existing folder."
            )
    return None


def supports_skip_locked(using: str | None = None) -> bool:
    """Whether ``SELECT ... FOR UPDATE SKIP LOCKED`` works on the alias ``using``.

    For ``claim_next`` over a user's own table, which may live on a database
    django-dbworker does not run its work table on: Django's own feature
    flag answers for those.
    """
    alias = using or DEFAULT_DB_ALIAS
    try:
        return operations(alias).supports_skip_locked
    except UnsupportedDatabase:
        return bool(connections[alias].features.has_select_for_update_skip_locked)


def skip_locked_options(using: str | None = None) -> dict[str, Any]:
    """``select_for_update`` arguments that lock only the queryset's own rows, skipping locked ones.

    ``of=("self",)`` keeps joined tables (a filter through a foreign key)
    unlocked where the database can say so; MariaDB cannot (no ``FOR
    UPDATE OF``), and locks the joined rows too there.
    """
    alias = using or DEFAULT_DB_ALIAS
    if connections[alias].features.has_select_for_update_of:
        return {"skip_locked": True, "of": ("self",)}
    return {"skip_locked": True}
