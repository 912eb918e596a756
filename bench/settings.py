"""Settings for the benchmarks: PostgreSQL from DATABASE_URL (durable commits)."""

from __future__ import annotations

import os

import dj_database_url

SECRET_KEY = "bench-only"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_dbworker",
    "bench.benchapp",
]
DATABASES = {"default": dj_database_url.parse(os.environ["DATABASE_URL"])}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DBWORKER = {
    "CONCURRENCY": int(os.environ.get("BENCH_CONCURRENCY", "8")),
    "POLL_INTERVAL": 1.0,
}
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "loggers": {"django_dbworker": {"handlers": ["stderr"], "level": "WARNING"}},
}
