"""The example project: django-dbworker on SQLite, with the admin.

Run it with ``scripts/demo`` (see the README). Set DATABASE_URL to try it on
PostgreSQL instead (needs ``pip install -e .[postgres] dj-database-url``).
"""

from __future__ import annotations

import os
from pathlib import Path

import django

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-project-insecure-key")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_prometheus",
    "django_dbworker",
    "django_dbworker.contrib.prometheus",  # queue gauges on this project's /metrics
    "example_project.demo",
]
if django.VERSION < (6, 0):  # Django's Tasks framework: the backport on 5.2
    INSTALLED_APPS.append("django_tasks")

# @task functions (example_project/demo/tasks.py) run on django-dbworker too.
TASKS = {
    "default": {
        "BACKEND": "django_dbworker.tasks.DBWorkerBackend",
        "QUEUES": [],  # any queue name
    }
}

MIDDLEWARE = [
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_prometheus.middleware.PrometheusAfterMiddleware",
]

ROOT_URLCONF = "example_project.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
WSGI_APPLICATION = "example_project.wsgi.application"

if os.environ.get("DATABASE_URL"):
    import dj_database_url

    DATABASES = {"default": dj_database_url.parse(os.environ["DATABASE_URL"])}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": BASE_DIR / "example.sqlite3",
            # What the django_dbworker system check asks for: WAL so the web
            # process and workers do not block each other, a generous busy
            # timeout, and IMMEDIATE transactions that wait for the write lock.
            "OPTIONS": {
                "timeout": 20,
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
        }
    }

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"

DBWORKER = {
    "CONCURRENCY": 4,
    "RETRY_BACKOFF": 3.0,
    "STALE_AFTER": 30.0,
}

# Tracing: OTEL_TRACES_EXPORTER=console prints spans, =otlp sends them to
# OTEL_EXPORTER_OTLP_ENDPOINT (default http://localhost:4318); unset, tracing
# stays off and costs nothing. See example_project/demo/tracing.py.

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {"django_dbworker": {"handlers": ["console"], "level": "INFO"}},
}
