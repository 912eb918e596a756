"""App configuration: registers system checks and discovers ``workers`` modules."""

from __future__ import annotations

from django.apps import AppConfig


class DBWorkerConfig(AppConfig):
    name = "django_dbworker"
    label = "django_dbworker"
    verbose_name = "Background work"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django_dbworker import checks  # noqa: F401 - registers the checks
        from django_dbworker.registry import autodiscover

        # Like admin.autodiscover(): every process (web and worker) knows every
        # handler name, so enqueue-by-name works everywhere.
        autodiscover()
