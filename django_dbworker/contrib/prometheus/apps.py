from __future__ import annotations

from django.apps import AppConfig


class PrometheusConfig(AppConfig):
    name = "django_dbworker.contrib.prometheus"
    label = "dbworker_prometheus"
    verbose_name = "django-dbworker Prometheus gauges"

    def ready(self) -> None:
        from django_dbworker.contrib.prometheus.collector import register

        register()
