"""App configuration: registers system checks, wires the layers, discovers ``workers``.

The one place where a declaration meets its implementation above it: the
``WorkItemHandler.enqueue`` class methods reach ``enqueuing`` through the port
connected here, so that ``handlers`` never imports upward.
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
        # Connected as soon as our models exist, before any app's ready():
        # an app listed earlier in INSTALLED_APPS may enqueue in its own.
        from django_dbworker import enqueuing
        from django_dbworker.handlers import connect_enqueuer

        connect_enqueuer(enqueuing)

    def ready(self) -> None:
        from django.db.backends.signals import connection_created

        from django_dbworker import (
            checks,  # noqa: F401 - checks register on import
            retention,  # noqa: F401 - its handler registers on import
        )
        from django_dbworker.completion import settle_rows, settle_rows_after_commit
        from django_dbworker.db import operations, prepare_session
        from django_dbworker.dependencies import lock_parents_of, wait_again
        from django_dbworker.discovery import autodiscover
        from django_dbworker.models import connect_endings, connect_row_locker

        # QuerySet.cancel locks the claimed rows it asks as the worker does,
        # and settles what the rows it cancels set off (dependents, batches).
        connect_row_locker(lambda using, ids: operations(using).locked_in_id_order(ids))
        connect_endings(
            transaction=lambda using: operations(using).ending_transaction(),
            settle=lambda using, ids: settle_rows(ids, using),
            settle_later=lambda using, ids: settle_rows_after_commit(ids, using),
            rewait=lambda using, ids: wait_again(ids, using),
            lock_parents=lambda using, ids: lock_parents_of(ids, using),
        )

        # Each vendor sets up its new sessions: MySQL's in UTC, so that
        # Django's Now() is the worker's clock (MySQLOperations.prepare_session).
        connection_created.connect(prepare_session, dispatch_uid="django_dbworker.prepare_session")

        # Like admin.autodiscover(): every process (web and worker) knows every
        # handler name, so enqueue-by-name works everywhere.
        autodiscover()
