"""System checks for ``DBWORKER`` settings and the database configuration.

Ids are stable: E001-E009 for settings values (E009: Django's USE_TZ),
W001-W009 for risky but working configurations. Checks read settings only;
they never connect.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register

from django_dbworker.conf import DEFAULTS

_POSITIVE_NUMBERS = (
    "POLL_INTERVAL",
    "HEARTBEAT_INTERVAL",
    "STALE_AFTER",
    "RETRY_BACKOFF",
    "RETRY_BACKOFF_MAX",
)
_POSITIVE_INTS = ("CONCURRENCY", "MAX_ATTEMPTS", "MAX_PAYLOAD_BYTES")
_NON_NEGATIVE_NUMBERS = ("SHUTDOWN_TIMEOUT",)
_NON_NEGATIVE_INTS = ("BATCH_SIZE",)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    for key in _POSITIVE_NUMBERS + _POSITIVE_INTS + _NON_NEGATIVE_NUMBERS + _NON_NEGATIVE_INTS:
        if key not in raw:
            continue
        value = raw[key]
        want_int = key in _POSITIVE_INTS + _NON_NEGATIVE_INTS
        ok_type = _is_int(value) if want_int else _is_number(value)
        if not ok_type:
            errors.append(
                Error(
                    f"DBWORKER[{key!r}] must be {'an integer' if want_int else 'a number'}, "
                    f"got {value!r}.",
                    id="django_dbworker.E003",
                )
            )
            continue
        positive = key in _POSITIVE_NUMBERS + _POSITIVE_INTS
        if (positive and value <= 0) or (not positive and value < 0):
            errors.append(
                Error(
                    f"DBWORKER[{key!r}] must be {'greater than 0' if positive else '0 or more'}, "
                    f"got {value!r}.",
                    id="django_dbworker.E004",
                )
            )
    if errors:
        return errors
    merged = {**DEFAULTS, **raw}
    cap = merged["MAX_ABANDONED_THREADS"]
    if cap is not None and (not _is_int(cap) or cap < 1):
        errors.append(
            Error(
                f"DBWORKER['MAX_ABANDONED_THREADS'] must be None or an integer of 1 or more, "
                f"got {cap!r}.",
                id="django_dbworker.E003",
            )
        )
    port = merged["METRICS_PORT"]
    if port is not None and (not _is_int(port) or not 0 < port < 65536):
        errors.append(
            Error(
                f"DBWORKER['METRICS_PORT'] must be None or a port number 1-65535, got {port!r}.",
                id="django_dbworker.E005",
            )
        )
    if not isinstance(merged["METRICS_ADDR"], str) or not merged["METRICS_ADDR"]:
        errors.append(
            Error("DBWORKER['METRICS_ADDR'] must be a non-empty string.", id="django_dbworker.E006")
        )
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
        if not _is_number(timeout) or timeout < 10:
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
