"""App configuration: registers the feature packages' models and the system checks,
connects enqueuing, discovers ``workers`` modules.

``WorkItemHandler.enqueue`` (a declaration) reaches ``enqueuing`` (above it) through
the port connected here, so that ``handlers`` never imports upward and an enqueue
before ``django.setup()`` says what is missing.
"""

from __future__ import annotations

from django.apps import AppConfig


class DBWorkerConfig(AppConfig):
    name = "django_dbworker"
    label = "django_dbworker"
    verbose_name = "Background work"
    default_auto_field = "django.db.models.BigAutoField"

    def import_models(self) -> None:
        super().import_models()
        # The rows of the feature packages are models of this app too: registered now,
        # with ``models.py``'s, so that migrations and the admin see them.
        # Connected as soon as our models exist, before any app's ready():
        # an app listed earlier in INSTALLED_APPS may enqueue in its own.
        from django_dbworker import enqueuing
        from django_dbworker.batches import models as batch_models  # noqa: F401
        from django_dbworker.fleet import models as fleet_models  # noqa: F401
        from django_dbworker.flow import models as flow_models  # noqa: F401
        from django_dbworker.handlers import connect_enqueuer

        connect_enqueuer(enqueuing)

    def ready(self) -> None:
        from django.db.backends.signals import connection_created

        from django_dbworker import (
            checks,  # noqa: F401 - checks register on import
            retention,  # noqa: F401 - its handler registers on import
        )
        from django_dbworker.db import prepare_session
        from django_dbworker.discovery import autodiscover

        # Each vendor sets up its new sessions: MySQL's in UTC, so that
        # Django's Now() is the worker's clock (MySQLOperations.prepare_session).
        connection_created.connect(prepare_session, dispatch_uid="django_dbworker.prepare_session")

        # Like admin.autodiscover(): every process (web and worker) knows every
        # handler name, so enqueue-by-name works everywhere.
        autodiscover()
