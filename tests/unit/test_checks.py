from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
from django.core.checks import run_checks
from django.test import override_settings

from django_dbworker.checks import (
    check_settings,
    check_time_zone_support,
    check_wakeup_database,
    sqlite_warnings,
)
from django_dbworker.conf import dbworker_settings

#: The checks without a database, as on Django 5.2: from Django 6.1, ``run_checks()``
#: runs the model checks against every alias (on SQLite: a query).
NO_DATABASES: list[str] = []


def ids(messages: list[Any]) -> list[str]:
    return [m.id for m in messages]


def test_test_settings_are_clean() -> None:
    assert check_settings() == []


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ([], ["django_dbworker.E001"]),
        ({"CONCURENCY": 4}, ["django_dbworker.E002"]),
        ({"CONCURRENCY": "8"}, ["django_dbworker.E003"]),
        ({"CONCURRENCY": 2.5}, ["django_dbworker.E003"]),
        ({"CONCURRENCY": True}, ["django_dbworker.E003"]),
        ({"POLL_INTERVAL": 0}, ["django_dbworker.E004"]),
        ({"SHUTDOWN_TIMEOUT": -1}, ["django_dbworker.E004"]),
        ({"BATCH_SIZE": -1}, ["django_dbworker.E004"]),
        ({"WAKEUP_WINDOW": -0.1}, ["django_dbworker.E004"]),
        ({"WAKEUP_WINDOW": "0.1"}, ["django_dbworker.E003"]),
        ({"WAKEUPS": 0}, ["django_dbworker.E003"]),
        ({"WAKEUP_DATABASE": ""}, ["django_dbworker.E003"]),
        ({"WAKEUP_DATABASE": 1}, ["django_dbworker.E003"]),
        ({"METRICS_PORT": 70000}, ["django_dbworker.E005"]),
        ({"METRICS_ADDR": ""}, ["django_dbworker.E006"]),
        ({"STALE_AFTER": 5.0, "HEARTBEAT_INTERVAL": 5.0}, ["django_dbworker.E007"]),
        ({"RETRY_BACKOFF": 10.0, "RETRY_BACKOFF_MAX": 1.0}, ["django_dbworker.E008"]),
    ],
)
def test_bad_settings_are_reported(value: Any, expected: list[str]) -> None:
    with override_settings(DBWORKER=value):
        assert ids(check_settings()) == expected


@pytest.mark.parametrize(
    "key",
    ["POLL_INTERVAL", "HEARTBEAT_INTERVAL", "STALE_AFTER", "SHUTDOWN_TIMEOUT", "WAKEUP_WINDOW"],
)
@pytest.mark.parametrize("value", [math.inf, 1e10])
def test_waits_no_thread_can_wait_for_are_reported(key: str, value: float) -> None:
    # Above threading.TIMEOUT_MAX, Condition.wait raises OverflowError in the
    # idle worker; the check says so at start-up instead.
    with override_settings(DBWORKER={key: value}):
        (message,) = check_settings()
    assert message.id == "django_dbworker.E019"
    assert key in message.msg
    assert "finite number of seconds" in message.msg and "TIMEOUT_MAX" in message.msg


def test_wakeup_database_must_be_a_postgresql_alias() -> None:
    # Wake-ups through a pooler are lost: WAKEUP_DATABASE names the
    # alias to LISTEN on; one that is no alias, or not PostgreSQL, is a warning.
    assert check_wakeup_database() == []
    postgres = {"ENGINE": "django.db.backends.postgresql", "NAME": "app"}
    sqlite = {"ENGINE": "django.db.backends.sqlite3", "NAME": "x.sqlite3"}
    with override_settings(DBWORKER={"WAKEUP_DATABASE": "direct"}):
        (message,) = check_wakeup_database()
        assert "django_dbworker.W005" in ids(
            run_checks(databases=NO_DATABASES)
        )  # registered, not only defined
    assert message.id == "django_dbworker.W005"
    assert "'direct'" in message.msg and "not an alias of DATABASES" in message.msg
    # The check reads settings.DATABASES only; Django warns that overriding it
    # does not rebuild the connections, which this test does not need.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Overriding setting DATABASES", UserWarning)
        with override_settings(
            DBWORKER={"WAKEUP_DATABASE": "direct"},
            DATABASES={"default": postgres, "direct": sqlite},
        ):
            (message,) = check_wakeup_database()
        assert message.id == "django_dbworker.W005" and "not PostgreSQL" in message.msg
        with override_settings(
            DBWORKER={"WAKEUP_DATABASE": "direct"},
            DATABASES={"default": postgres, "direct": postgres},
        ):
            assert check_wakeup_database() == []


def test_use_tz_is_required() -> None:
    # Without USE_TZ, SQLite stores a naive run_after as local time but the
    # claim compares it with the database's UTC clock: work runs hours early.
    assert "django_dbworker.E009" not in ids(run_checks(databases=NO_DATABASES))
    with override_settings(USE_TZ=False):
        assert "django_dbworker.E009" in ids(
            run_checks(databases=NO_DATABASES)
        )  # registered, not only defined
        (message,) = check_time_zone_support()
    assert message.id == "django_dbworker.E009"
    assert "USE_TZ" in message.msg and message.hint and "USE_TZ = True" in message.hint


def test_every_message_names_the_key() -> None:
    with override_settings(DBWORKER={"MAX_ATTEMPTS": 0}):
        (message,) = check_settings()
    assert "MAX_ATTEMPTS" in message.msg


def test_settings_object_follows_override_settings() -> None:
    assert dbworker_settings.MAX_ATTEMPTS == 3
    with override_settings(DBWORKER={"MAX_ATTEMPTS": 9}):
        assert dbworker_settings.MAX_ATTEMPTS == 9
    assert dbworker_settings.MAX_ATTEMPTS == 3


def test_unknown_keys_are_not_attributes() -> None:
    with pytest.raises(AttributeError):
        dbworker_settings.NOT_A_SETTING  # noqa: B018


def _sqlite(options: dict[str, Any]) -> dict[str, Any]:
    return {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "x", "OPTIONS": options}}


def test_unsafe_sqlite_settings_warn() -> None:
    assert ids(sqlite_warnings(_sqlite({}))) == [
        "django_dbworker.W001",
        "django_dbworker.W002",
        "django_dbworker.W003",
    ]


def test_safe_sqlite_settings_do_not_warn() -> None:
    options = {
        "init_command": "PRAGMA journal_mode = WAL;",
        "timeout": 20,
        "transaction_mode": "IMMEDIATE",
    }
    assert sqlite_warnings(_sqlite(options)) == []


@pytest.mark.parametrize(
    ("is_mariadb", "version", "refused"),
    [
        (True, (10, 5, 22), True),
        (True, (10, 6, 0), False),
        (True, (10, 11, 19), False),
        (False, (5, 7, 44), True),
        (False, (8, 0, 0), True),
        (False, (8, 0, 1), False),
        (False, (8, 4, 3), False),
    ],
)
def test_mysql_versions_without_skip_locked_are_refused(
    is_mariadb: bool, version: tuple[int, ...], refused: bool
) -> None:
    from django_dbworker.db.mysql import unsupported_version

    problem = unsupported_version(is_mariadb=is_mariadb, version=version)
    if not refused:
        assert problem is None
        return
    assert problem is not None
    assert ("MariaDB 10.6" if is_mariadb else "MySQL 8.0.1") in problem
    assert ".".join(map(str, version)) in problem


def test_e023_refuses_only_the_async_entry_points_that_cannot_run() -> None:
    """``async def handle`` runs on the worker's event loop: no error. With ``atomic = True``
    (a transaction cannot span the loop's awaits), as a periodic handler's ``run`` (its
    plain ``handle`` would never await it) and as an own-table handler's ``process`` (run
    on a thread), E023 says why."""
    from django_dbworker import Handler, PeriodicHandler, WorkItemHandler
    from django_dbworker.checks import async_handler_errors

    async def handle(self: Any, payload: Any) -> None:
        return None

    async def run(self: Any) -> None:
        return None

    sync = type("Sync", (WorkItemHandler,), {"name": "sync_one", "abstract": True})
    fine = type("Fine", (WorkItemHandler,), {"name": "fine", "abstract": True, "handle": handle})
    atomic = type(
        "Late",
        (WorkItemHandler,),
        {"name": "late", "abstract": True, "handle": handle, "atomic": True},
    )
    periodic = type(
        "Tick", (PeriodicHandler,), {"name": "tick", "abstract": True, "every": 60, "run": run}
    )
    own = type(
        "Own",
        (Handler,),
        {"name": "own", "abstract": True, "claim": lambda self: None, "process": handle},
    )
    errors = async_handler_errors([sync, fine, atomic, periodic, own])
    assert [e.id for e in errors] == ["django_dbworker.E023"] * 3
    assert "'late'" in errors[0].msg and "atomic = True" in errors[0].msg
    assert "async def run" in errors[1].msg and "async def handle" in errors[1].hint
    assert "async def process" in errors[2].msg and "own-table" in errors[2].msg


def test_e023_leaves_an_async_helper_named_run_of_a_plain_handler_alone() -> None:
    """E023 refuses a *periodic* handler's ``async def run`` (its entry point, docs/reference/
    settings.md), not an async helper a plain WorkItemHandler happens to call ``run`` and
    runs from ``handle`` with ``async_to_sync``, as Handlers ("Async code in a handler")
    tells users to: that handler works, and an E023 error would stop ``run_workers``."""
    from asgiref.sync import async_to_sync

    from django_dbworker import WorkItemHandler
    from django_dbworker.checks import async_handler_errors

    async def run(self: Any, payload: Any) -> int:
        return int(payload) * 2

    def handle(self: Any, payload: Any) -> int:
        return int(async_to_sync(self.run)(payload))

    fetch = type(
        "Fetch",
        (WorkItemHandler,),
        {"name": "fetch", "abstract": True, "handle": handle, "run": run},
    )
    assert fetch().handle(21) == 42  # a working handler
    assert async_handler_errors([fetch]) == []


def test_e023_refuses_an_async_def_handle_that_yields() -> None:
    """``async def handle`` with a ``yield`` in it (an async generator function) is still an
    ``async def handle``: the worker stores the async generator it returns, having run none of
    it, and the item fails with "not JSON-serialisable" instead of the check naming it."""
    from django_dbworker import WorkItemHandler
    from django_dbworker.checks import async_handler_errors

    async def handle(self: Any, payload: Any) -> Any:
        yield payload

    streams = type(
        "Streams", (WorkItemHandler,), {"name": "streams", "abstract": True, "handle": handle}
    )
    assert [e.id for e in async_handler_errors([streams])] == ["django_dbworker.E023"]
