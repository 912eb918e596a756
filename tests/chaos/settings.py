"""Settings of the chaos runner's workers: the suite's settings with fast clocks.

Environment (set by ``tests.chaos.runner`` for itself and its workers):

- ``CHAOS_DATABASE_URL``: the runner's own throwaway PostgreSQL (never the
  suite's database: the runner freezes and reconfigures its server).
- ``CHAOS_RUN_DIR``: where handlers keep their run counters and run log.
- ``CHAOS_ROLE``: ``worker`` or ``runner``; sets the connection's
  ``application_name`` so that faults can target the workers' connections,
  and keeps the runner's own session writable during read-only windows.
"""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url

from tests.settings import *  # noqa: F403
from tests.settings import BASE_DIR, DATABASES, INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "tests.chaos"]

RUN_DIR = Path(os.environ.get("CHAOS_RUN_DIR", str(BASE_DIR.parent / ".tmp" / "chaos-manual")))
ROLE = os.environ.get("CHAOS_ROLE", "worker")
#: application_name of worker connections: what the connection-kill fault targets.
WORKER_APPLICATION_NAME = "dbworker-chaos-worker"
RUNNER_APPLICATION_NAME = "dbworker-chaos-runner"

if os.environ.get("CHAOS_DATABASE_URL"):
    _options: dict[str, str] = {
        "application_name": (
            RUNNER_APPLICATION_NAME if ROLE == "runner" else WORKER_APPLICATION_NAME
        )
    }
    if ROLE == "runner":
        # A startup option outranks postgresql.auto.conf: the runner's session
        # stays writable while ALTER SYSTEM makes every other session read-only.
        _options["options"] = "-c default_transaction_read_only=off"
    DATABASES = {
        "default": {
            **dj_database_url.parse(os.environ["CHAOS_DATABASE_URL"]),
            "OPTIONS": _options,
        }
    }
else:
    # Without the runner's cluster (makemigrations, check): the suite's database.
    DATABASES = {"default": dict(DATABASES["default"])}

if ROLE == "worker":
    # Counters live in files, one per process: a SIGKILLed worker's counts survive.
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", str(RUN_DIR / "metrics"))
    Path(os.environ["PROMETHEUS_MULTIPROC_DIR"]).mkdir(parents=True, exist_ok=True)
    (RUN_DIR / "runs").mkdir(parents=True, exist_ok=True)

#: Heartbeat age that marks a row stale; the faults' pauses are sized from it.
STALE_AFTER = 3.0

DBWORKER = {
    "CONCURRENCY": 4,
    "POLL_INTERVAL": 0.2,
    "HEARTBEAT_INTERVAL": 0.5,
    "STALE_AFTER": STALE_AFTER,
    "SHUTDOWN_TIMEOUT": 5.0,
    "MAX_ATTEMPTS": 3,
    "RETRY_BACKOFF": 0.2,
    "RETRY_BACKOFF_MAX": 2.0,
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "chaos": {
            "format": "%(asctime)s.%(msecs)03d pid=%(process)d %(threadName)s "
            "%(levelname)s %(name)s: %(message)s",
            "datefmt": "%H:%M:%S",
        }
    },
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "chaos"}},
    "loggers": {"django_dbworker": {"handlers": ["stderr"], "level": "INFO"}},
}
