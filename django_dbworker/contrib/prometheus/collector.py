"""A collector that reads queue sizes and lag from the database at scrape time."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from django_dbworker.flow.models import QueueState
from django_dbworker.models import Status
from django_dbworker.routing import work_db_for_read
from django_dbworker.stats import queue_stats

logger = logging.getLogger("django_dbworker.metrics")


class QueueCollector(Collector):
    """The queue gauges: items by status, the oldest pending age, and whether paused.

    ``dbworker_queue_items``, ``dbworker_queue_oldest_pending_age_seconds``
    and ``dbworker_queue_paused``.

    Two grouped queries per scrape (see ``stats.queue_stats``): exact counts
    of live and failed rows, planner estimates for finished rows of large
    PostgreSQL tables; and a read of the few ``QueueState`` rows (1 for a
    paused queue, 0 for the others of the table or with a row). A database
    error yields no samples, not a failed scrape.
    """

    def __init__(self, using: str | None = None) -> None:
        self.using = using

    def describe(self) -> list[Any]:
        # Describing without querying lets registration happen before the
        # database is reachable (and in processes that never scrape).
        return [
            GaugeMetricFamily(
                "dbworker_queue_items",
                "Work items by queue and status.",
                labels=["queue", "status"],
            ),
            GaugeMetricFamily(
                "dbworker_queue_oldest_pending_age_seconds",
                "Age of the oldest claimable item per queue (queue lag).",
                labels=["queue"],
            ),
            GaugeMetricFamily(
                "dbworker_queue_paused",
                "1 while a queue is paused (no worker claims its items), else 0.",
                labels=["queue"],
            ),
        ]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        items, lag, paused = self.describe()
        try:
            stats = queue_stats(using=self.using)
            states = dict(
                QueueState.objects.using(work_db_for_read(self.using)).values_list("name", "paused")
            )
        except Exception:
            logger.exception("Could not read queue sizes for /metrics.")
            return
        for queue, entry in sorted(stats.items()):
            for status in Status:
                items.add_metric([queue, status.value], entry["counts"].get(status.value, 0))
            lag.add_metric([queue], entry["oldest_pending_age"] or 0.0)
        for queue in sorted(set(stats) | set(states)):
            paused.add_metric([queue], 1.0 if states.get(queue) else 0.0)
        yield items
        yield lag
        yield paused


_registered: dict[int, QueueCollector] = {}


def register(registry: Any = None) -> QueueCollector:
    """Register the queue collector once on ``registry`` (default: the global one)."""
    registry = registry if registry is not None else REGISTRY
    key = id(registry)
    if key not in _registered:
        collector = QueueCollector()
        registry.register(collector)
        _registered[key] = collector
    return _registered[key]


def unregister(registry: Any = None) -> None:
    registry = registry if registry is not None else REGISTRY
    collector = _registered.pop(id(registry), None)
    if collector is not None:
        registry.unregister(collector)
