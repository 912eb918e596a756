"""/metrics of real run_workers processes, over HTTP; several processes per host."""

from __future__ import annotations

import signal
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from django_dbworker.models import Status, WorkItem
from tests.conftest import wait_until
from tests.testapp.workers import Record

pytestmark = pytest.mark.django_db(transaction=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def succeeded_tasks(samples: dict, worker: str = "record") -> float:
    key = ("worker_tasks_total", (("status", "succeeded"), ("worker", worker)))
    return samples.get(key, 0.0)


def try_scrape(port: int) -> dict | None:
    try:
        return scrape(port)
    except OSError:
        return None


def all_done(n: int) -> bool:
    return WorkItem.objects.filter(status=Status.SUCCEEDED).count() == n


def test_worker_serves_its_metrics_on_loopback(start_worker) -> None:
    port = free_port()
    worker = start_worker("record", "--metrics-port", str(port))
    wait_until(lambda: try_scrape(port) is not None, what="the metrics server to answer")
    Record.enqueue_many([{"key": str(i)} for i in range(7)])
    wait_until(lambda: all_done(7))
    wait_until(lambda: succeeded_tasks(scrape(port)) == 7, what="the counter to reach 7")
    # The pool thread lowers the gauge after its hand-over, unordered with the count.
    wait_until(
        lambda: scrape(port)[("worker_tasks_in_flight", (("worker", "record"),))] == 0,
        what="the in-flight gauge to go back to 0",
    )
    samples = scrape(port)
    assert samples[("worker_poll_cycles_total", (("worker", "workitems"),))] >= 1
    # The queue gauges are the web process's; a worker does not export them.
    assert not [k for k in samples if k[0].startswith("dbworker_queue")]
    with socket.create_connection(("127.0.0.1", port)) as conn:
        assert conn.getpeername()[0] == "127.0.0.1"
    assert "Serving Prometheus metrics on http://127.0.0.1:" in worker.log()
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0


def test_a_taken_port_is_a_clear_startup_error(start_worker) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = start_worker("record", "--metrics-port", str(port))
        assert worker.wait() == 1
    assert f"Cannot serve metrics on 127.0.0.1:{port}" in worker.log()


def test_one_port_per_process_adds_up(start_worker) -> None:
    ports = [free_port(), free_port()]
    workers = [start_worker("record", "--metrics-port", str(p)) for p in ports]
    for port in ports:
        wait_until(lambda p=port: try_scrape(p) is not None)
    Record.enqueue_many([{"key": str(i)} for i in range(200)])
    wait_until(lambda: all_done(200), timeout=60)
    wait_until(
        lambda: sum(succeeded_tasks(scrape(p)) for p in ports) == 200,
        what="the two endpoints to add up to 200",
    )
    for worker in workers:
        worker.signal(signal.SIGTERM)
        assert worker.wait() == 0


def test_multiprocess_mode_aggregates_every_process(start_worker, tmp_path: Path) -> None:
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    # A first process does half the work and exits...
    Record.enqueue_many([{"key": str(i)} for i in range(100)])
    first = start_worker("record", "--burst", env=env)
    assert first.wait() == 0
    # ...a second one, the only one serving /metrics, does the other half.
    port = free_port()
    serving = start_worker("record", "--metrics-port", str(port), env=env)
    wait_until(lambda: try_scrape(port) is not None)
    Record.enqueue_many([{"key": str(i)} for i in range(100, 200)])
    wait_until(lambda: all_done(200), timeout=60)
    wait_until(
        lambda: succeeded_tasks(scrape(port)) == 200,
        what="one endpoint to report the work of both processes",
    )
    serving.signal(signal.SIGTERM)
    assert serving.wait() == 0
