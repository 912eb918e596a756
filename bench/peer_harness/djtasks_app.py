"""The django-tasks-db side: settings and the no-op task (imported by its worker)."""

from __future__ import annotations

import os

import django
from django.conf import settings

if not settings.configured:
    url = os.environ["DATABASE_URL"]
    from urllib.parse import urlparse

    parts = urlparse(url)
    settings.configure(
        DEBUG=False,
        USE_TZ=True,
        INSTALLED_APPS=["django_tasks", "django_tasks_db"],
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": parts.path.lstrip("/"),
                "USER": parts.username,
                "HOST": parts.hostname,
                "PORT": parts.port,
            }
        },
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
