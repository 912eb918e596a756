"""Settings for the benchmarks: PostgreSQL (or MariaDB) from DATABASE_URL (durable commits)."""

from __future__ import annotations

import os

import dj_database_url
import django

SECRET_KEY = "bench-only"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_dbworker",
    "bench.benchapp",
]
# Django's Tasks framework, for bench/tasks_compare.py only (it sets
# BENCH_TASKS): the @task functions of bench/benchapp/tasks.py run on
# django-dbworker, and run_workers then also knows them by import path. The
# other benchmarks measure the package's own API, in a project that has no
# use for the backport on Django 5.2 (importing it and django_stubs_ext was
# 25-35 ms of every worker's start).
if os.environ.get("BENCH_TASKS"):
    if django.VERSION < (6, 0):
        INSTALLED_APPS.append("django_tasks")
    TASKS = {"default": {"BACKEND": "django_dbworker.tasks.DBWorkerBackend"}}
DATABASES = {"default": dj_database_url.parse(os.environ["DATABASE_URL"])}
if DATABASES["default"]["ENGINE"] == "django.db.backends.mysql":
    # A mysql:// URL (scripts/mariadbcluster.py start --durable): utf8mb4, and
    # the checks Django raises about the model's partial indexes are known
    # (the initial migration builds MySQL's own; see tests/settings.py).
    DATABASES["default"]["OPTIONS"] = {"charset": "utf8mb4"}
    SILENCED_SYSTEM_CHECKS = ["models.W036", "models.W037", "models.W043"]
# BENCH_PREPARE_THRESHOLD=N: psycopg's prepare_threshold (Django's default is
# None: nothing prepared). Django's own ClientCursors are never prepared; the
# enqueue statements are, on a cursor of their own (db/postgresql.py).
if os.environ.get("BENCH_PREPARE_THRESHOLD"):
    DATABASES["default"]["OPTIONS"] = {
        "prepare_threshold": int(os.environ["BENCH_PREPARE_THRESHOLD"])
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DBWORKER: dict[str, object] = {
    "CONCURRENCY": int(os.environ.get("BENCH_CONCURRENCY", "8")),
    "POLL_INTERVAL": 1.0,
}
# BENCH_WAKEUP_WINDOW=seconds: WAKEUP_WINDOW for the enqueuers and the workers
# alike (bench/w3_latency.py measured with and without it, issue 23).
if os.environ.get("BENCH_WAKEUP_WINDOW"):
    DBWORKER["WAKEUP_WINDOW"] = float(os.environ["BENCH_WAKEUP_WINDOW"])
# BENCH_PREFETCH_HORIZON=seconds: how much work a worker buffers (W12: a fair key's
# turn waits behind the buffer).
if os.environ.get("BENCH_PREFETCH_HORIZON"):
    DBWORKER["PREFETCH_HORIZON"] = float(os.environ["BENCH_PREFETCH_HORIZON"])
# BENCH_DIRECT_URL: a "direct" alias (PostgreSQL, not through a pooler) for
# WAKEUP_DATABASE, and BENCH_POLL_INTERVAL (bench/pgbouncer_wakeups.py).
if os.environ.get("BENCH_DIRECT_URL"):
    DATABASES["direct"] = {
        **dj_database_url.parse(os.environ["BENCH_DIRECT_URL"]),
        "NAME": DATABASES["default"]["NAME"],  # NOTIFY reaches listeners of its database only
    }
if os.environ.get("BENCH_WAKEUP_DATABASE"):
    DBWORKER["WAKEUP_DATABASE"] = os.environ["BENCH_WAKEUP_DATABASE"]
if os.environ.get("BENCH_POLL_INTERVAL"):
    DBWORKER["POLL_INTERVAL"] = float(os.environ["BENCH_POLL_INTERVAL"])
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "loggers": {"django_dbworker": {"handlers": ["stderr"], "level": "WARNING"}},
}
