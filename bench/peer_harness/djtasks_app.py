"""The django-tasks-db side: settings and the no-op task (imported by its worker)."""

from __future__ import annotations

import os

import django
from django.conf import settings

if not settings.configured:
    url = os.environ["DATABASE_URL"]
    from urllib.parse import urlparse

    parts = urlparse(url)
    # BENCH_DJTASKS_CONN_MAX_AGE: Django's CONN_MAX_AGE ("none": never closed).
    # Unset, Django's default 0: db_worker's close_old_connections() then
    # closes the connection after every task, and the next one reconnects.
    max_age = os.environ.get("BENCH_DJTASKS_CONN_MAX_AGE", "0")
    database = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parts.path.lstrip("/"),
        "USER": parts.username,
        "PASSWORD": parts.password or "",
        "HOST": parts.hostname,
        "PORT": parts.port,
        "CONN_MAX_AGE": None if max_age == "none" else int(max_age),
    }
    if parts.scheme in ("mysql", "mariadb"):
        # A mysql:// URL (bench/peers.py --mysql): Django's MySQL backend on
        # mysqlclient, utf8mb4 as in bench/settings.py.
        database["ENGINE"] = "django.db.backends.mysql"
        database["OPTIONS"] = {"charset": "utf8mb4"}
    settings.configure(
        DEBUG=False,
        USE_TZ=True,
        INSTALLED_APPS=["django_tasks", "django_tasks_db"],
        DATABASES={"default": database},
        TASKS={"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}},
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
    )
    django.setup()

from django_tasks import task
from peer_common import stamp


@task()
def noop(key: str = "") -> None:
    if key:
        stamp(key)
