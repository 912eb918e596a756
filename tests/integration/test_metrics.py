"""Worker metrics on an injected registry, and the web process's queue gauges."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db.models.functions import Now
from django.test import Client
from prometheus_client import CollectorRegistry

from django_dbworker.contrib.prometheus.collector import register, unregister
from django_dbworker.metrics import WORK_ITEM_LOOP, WorkerMetrics
from django_dbworker.models import Status, WorkItem
from django_dbworker.registry import registry as handlers
from django_dbworker.worker import Worker
from django_dbworker.worker.runtime import WorkerConfig
from tests.conftest import wait_until
from tests.factories import make_item
from tests.testapp.workers import Flaky, Noop, NoRetry, Slow

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def reg() -> CollectorRegistry:
    return CollectorRegistry()


def value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    return reg.get_sample_value(name, labels) or 0.0


def test_counters_and_histograms_after_a_mixed_run(reg: CollectorRegistry) -> None:
    Noop.enqueue_many([None] * 3)
    NoRetry.enqueue({"key": "n"})
    Flaky.enqueue({"key": "f", "fail_times": 1})
    Slow.enqueue({"key": "s", "seconds": 1.0})
    # A row left behind by a dead worker: recovered, then run.
    make_item(
        handler="noop",
        status=Status.CLAIMED,
        attempts=1,
        claimed_by="dead:1:x",
        heartbeat_at=Now() - timedelta(hours=1),
    )
    metrics = WorkerMetrics(reg)
    worker = Worker(
        [handlers[n] for n in ("noop", "no_retry", "flaky", "slow")],
        WorkerConfig(concurrency=4, poll_interval=0.05, heartbeat_interval=0.2, stale_after=1.0),
        metrics=metrics,
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_until(
            lambda: not WorkItem.objects.filter(status__in=["pending", "claimed"]).exists(),
            timeout=30,
            what="every item to finish",
        )
    finally:
        worker.stop(immediate=True)
        thread.join(10)
        # Abandoned (timed-out) handler threads finish before the next test.
        wait_until(
            lambda: not [t for t in threading.enumerate() if t.name.startswith("dbworker")],
            timeout=30,
            what="worker threads to end",
        )
    expected = {
        ("noop", "succeeded"): 4,
        ("no_retry", "failed"): 1,
        ("flaky", "retried"): 1,
        ("flaky", "succeeded"): 1,
        ("slow", "timeout"): 2,
    }
    for (worker_name, status), count in expected.items():
        assert value(reg, "worker_tasks_total", worker=worker_name, status=status) == count
        assert (
            value(reg, "worker_task_duration_seconds_count", worker=worker_name, status=status)
            == count
        )
    assert value(reg, "worker_tasks_total", worker="noop", status="failed") == 0
    assert value(reg, "worker_stale_recovered_total", worker="noop") == 1
    for name in ("noop", "no_retry", "flaky", "slow"):
        assert value(reg, "worker_tasks_in_flight", worker=name) == 0
    polls = value(reg, "worker_poll_cycles_total", worker=WORK_ITEM_LOOP)
    assert polls >= 5
    assert value(reg, "worker_claim_duration_seconds_count", worker=WORK_ITEM_LOOP) == polls
    assert value(reg, "worker_recover_stale_duration_seconds_count", worker=WORK_ITEM_LOOP) >= 1
    assert value(reg, "worker_claim_errors_total", worker=WORK_ITEM_LOOP) == 0
    # Durations land in sensible buckets: the 0.5 s timeouts are above 0.25 s.
    assert (
        value(
            reg, "worker_task_duration_seconds_bucket", worker="slow", status="timeout", le="0.25"
        )
        == 0
    )


def test_metrics_are_registered_once_per_registry(reg: CollectorRegistry) -> None:
    WorkerMetrics(reg)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        WorkerMetrics(reg)


def test_queue_gauges_are_read_from_the_database(reg: CollectorRegistry) -> None:
    make_item(queue="mail")
    make_item(queue="mail", status=Status.FAILED)
    make_item(queue="mail", run_after=Now() - timedelta(seconds=90))
    register(reg)
    try:
        assert value(reg, "dbworker_queue_items", queue="mail", status="pending") == 2
        assert value(reg, "dbworker_queue_items", queue="mail", status="failed") == 1
        assert value(reg, "dbworker_queue_items", queue="mail", status="succeeded") == 0
        lag = value(reg, "dbworker_queue_oldest_pending_age_seconds", queue="mail")
        assert 89 <= lag < 150
    finally:
        unregister(reg)


def test_web_metrics_endpoint_exports_queue_gauges(client: Client) -> None:
    make_item(queue="web")
    body = client.get("/metrics").content.decode()
    assert 'dbworker_queue_items{queue="web",status="pending"} 1.0' in body
