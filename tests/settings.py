"""Settings for the test suite; the database comes from DATABASE_URL.

Without DATABASE_URL the suite runs on a SQLite file (not :memory:, because
process tests start ``run_workers`` subprocesses that must share it).
"""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url
import django

BASE_DIR = Path(__file__).resolve().parent
SECRET_KEY = "tests-only-not-secret"
# The tests log users in by the hundred: a slow password hash would cost seconds of CPU each
# time (Django's default is made slow on purpose); what the tests prove does not depend on it.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS = ["*"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_prometheus",
    "django_dbworker",
    "django_dbworker.contrib.prometheus",
    "tests.testapp",
]
# Django's Tasks framework: built in from Django 6, the backport on 5.2.
if django.VERSION < (6, 0):
    INSTALLED_APPS.append("django_tasks")

# @task functions of tests/testapp/tasks.py run on django-dbworker.
TASKS = {
    "default": {
        "BACKEND": "django_dbworker.tasks.DBWorkerBackend",
        "QUEUES": ["default", "tasks", "other"],
    },
    "patient": {
        "BACKEND": "django_dbworker.tasks.DBWorkerBackend",
        "QUEUES": [],
        "OPTIONS": {"MAX_ATTEMPTS": 4, "TIMEOUT": 30},
    },
    # Only the number of attempts differs from "default": its tasks run alike.
    "retrying": {
        "BACKEND": "django_dbworker.tasks.DBWorkerBackend",
        "OPTIONS": {"MAX_ATTEMPTS": 6},
    },
}

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.urls"
STATIC_URL = "static/"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
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

_sqlite_file = os.environ.get(
    "DBWORKER_TEST_SQLITE", str(BASE_DIR.parent / ".tmp" / "test.sqlite3")
)
_url = os.environ.get("DATABASE_URL", "")
if _url:
    DATABASES = {"default": dj_database_url.parse(_url)}
    if DATABASES["default"]["ENGINE"] == "django.db.backends.mysql":
        # utf8mb4: payloads and errors hold any Unicode (MySQL's "utf8" is 3 bytes).
        DATABASES["default"]["OPTIONS"] = {"charset": "utf8mb4"}
        DATABASES["default"]["TEST"] = {"CHARSET": "utf8mb4", "COLLATION": "utf8mb4_unicode_ci"}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": _sqlite_file,
            "OPTIONS": {
                "timeout": 30,
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
            "TEST": {"NAME": _sqlite_file},
        }
    }

# A second database for the test of the database alias rule
# (tests/integration/test_routing.py): the same server, another database. Only
# that test asks for it (so only then is its test database created), and only
# there does a router (tests.routers) send the work table to it.
if _url:
    DATABASES["work"] = {
        **DATABASES["default"],
        "NAME": f"{DATABASES['default']['NAME']}_work",
        "TEST": {
            key: value
            for key, value in DATABASES["default"].get("TEST", {}).items()
            if key in ("CHARSET", "COLLATION")
        },
    }
else:
    _work_file = _sqlite_file.removesuffix(".sqlite3") + "-work.sqlite3"
    DATABASES["work"] = {
        **DATABASES["default"],
        "NAME": _work_file,
        "TEST": {"NAME": _work_file},
    }

# The PgBouncer leg (scripts/test): DATABASE_URL goes through PgBouncer in
# transaction mode (scripts/pgbouncer.py), DBWORKER_DIRECT_URL to the same
# cluster directly. As the docs tell users (Deployment, "PgBouncer and other
# poolers"): no prepared statements (psycopg's prepare_threshold None, which
# is Django's default, spelled out) and no server-side cursors; "direct"
# is the alias WAKEUP_DATABASE names. It mirrors "default" in tests: the
# same test database, reached without the pooler.
if os.environ.get("DBWORKER_DIRECT_URL"):
    DATABASES["default"]["OPTIONS"] = {"prepare_threshold": None}
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
    DATABASES["direct"] = {
        **dj_database_url.parse(os.environ["DBWORKER_DIRECT_URL"]),
        "NAME": DATABASES["default"]["NAME"],
        "TEST": {"MIRROR": "default"},
    }

# Process tests point run_workers subprocesses at the test database by name.
if os.environ.get("DBWORKER_TEST_DB_NAME"):
    DATABASES["default"]["NAME"] = os.environ["DBWORKER_TEST_DB_NAME"]
    if "direct" in DATABASES:
        DATABASES["direct"]["NAME"] = os.environ["DBWORKER_TEST_DB_NAME"]
if os.environ.get("DBWORKER_TEST_WORK_DB_NAME"):
    DATABASES["work"]["NAME"] = os.environ["DBWORKER_TEST_WORK_DB_NAME"]
elif os.environ.get("DBWORKER_TEST_DB_NAME") and _url:
    # No queue database of its own: "work" names the test database, which
    # exists. From Django 6.1 the system checks of every command (run_workers'
    # included) look at every alias, and on MySQL/MariaDB that connects (the
    # column types depend on the server's version): "<name>_work" was never
    # created outside the routing tests.
    DATABASES["work"]["NAME"] = os.environ["DBWORKER_TEST_DB_NAME"]
# The development migrations, for the test that compares them with the one of 0.1
# (tests/integration/test_migrations.py).
if os.environ.get("DBWORKER_TEST_MIGRATIONS"):
    MIGRATION_MODULES = {"django_dbworker": os.environ["DBWORKER_TEST_MIGRATIONS"]}
# ... and, for a queue database of its own (tests/process/test_queue_database.py),
# at the router that puts the work there.
if os.environ.get("DBWORKER_TEST_ROUTERS"):
    DATABASE_ROUTERS = os.environ["DBWORKER_TEST_ROUTERS"].split(",")

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# MySQL has no partial indexes or conditional unique constraints, and
# MariaDB no expression indexes: Django builds or skips those of WorkItem
# there and says so (models.W036, W037, W043). The initial migration gives MySQL
# its own claim indexes and a unique generated column instead, so on MySQL
# those warnings are known and silenced, and only there.
if DATABASES["default"]["ENGINE"] == "django.db.backends.mysql" and not os.environ.get(
    "DBWORKER_TEST_UNSILENCED"
):
    SILENCED_SYSTEM_CHECKS = ["models.W036", "models.W037", "models.W043"]

# Fast clocks for the process tests; the suite never waits on production defaults.
DBWORKER: dict[str, object] = {
    "POLL_INTERVAL": float(os.environ.get("DBWORKER_POLL_INTERVAL", "0.2")),
    "HEARTBEAT_INTERVAL": float(os.environ.get("DBWORKER_HEARTBEAT_INTERVAL", "0.3")),
    "STALE_AFTER": float(os.environ.get("DBWORKER_STALE_AFTER", "60")),
    "SHUTDOWN_TIMEOUT": float(os.environ.get("DBWORKER_SHUTDOWN_TIMEOUT", "10")),
    "RETRY_BACKOFF": float(os.environ.get("DBWORKER_RETRY_BACKOFF", "0.05")),
    "RETRY_BACKOFF_MAX": float(os.environ.get("DBWORKER_RETRY_BACKOFF_MAX", "1.0")),
    "CONCURRENCY": int(os.environ.get("DBWORKER_CONCURRENCY", "4")),
}
if os.environ.get("DBWORKER_PREFETCH_HORIZON"):
    DBWORKER["PREFETCH_HORIZON"] = float(os.environ["DBWORKER_PREFETCH_HORIZON"])
if os.environ.get("DBWORKER_WAKEUP_WINDOW"):
    DBWORKER["WAKEUP_WINDOW"] = float(os.environ["DBWORKER_WAKEUP_WINDOW"])
if os.environ.get("DBWORKER_WAKEUPS"):
    DBWORKER["WAKEUPS"] = os.environ["DBWORKER_WAKEUPS"] == "1"
if os.environ.get("DBWORKER_WAKEUP_DATABASE"):
    DBWORKER["WAKEUP_DATABASE"] = os.environ["DBWORKER_WAKEUP_DATABASE"]
if os.environ.get("DBWORKER_MAX_ABANDONED_THREADS"):
    DBWORKER["MAX_ABANDONED_THREADS"] = int(os.environ["DBWORKER_MAX_ABANDONED_THREADS"])

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "loggers": {"django_dbworker": {"handlers": ["stderr"], "level": "INFO"}},
}
