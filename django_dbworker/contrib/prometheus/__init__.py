"""Queue gauges for the web process's ``/metrics`` (django-prometheus).

Add ``"django_dbworker.contrib.prometheus"`` to INSTALLED_APPS of the web
project: ``dbworker_queue_items{queue,status}`` and
``dbworker_queue_oldest_pending_age_seconds{queue}`` are then collected from
the database at each scrape of the default registry, which django-prometheus
exports. Worker processes leave these gauges out of their own ``/metrics``
(every worker would report the same global numbers).

Cardinality: each distinct queue name in the table adds six series (five
statuses and the oldest pending age), with no cap; queue names should be
a fixed few, not one per tenant or request (docs/topics/observability.md).
"""
