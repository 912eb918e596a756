"""Prometheus metrics of the worker runtime, on an injectable registry.

``prometheus_client`` is optional (the ``prometheus`` extra): without it
every recording call is a no-op. Metrics are created once per registry,
however many handlers and threads record them. Label ``worker`` is the
handler name for per-task metrics; the shared WorkItem claim loop, which
claims for all WorkItem handlers at once, reports its loop metrics under
``worker="workitems"``.

Several worker processes on one host either get one ``--metrics-port`` each,
or share prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``
set for all of them, one of them serving ``/metrics`` for all); see
``serve``.

``serve`` binds ``127.0.0.1`` unless told otherwise, and logs a warning at
start when the address answers beyond this host (``0.0.0.0``, ``::``, a
routable address): ``/metrics`` has no authentication, and its handler and
queue names tell a reader what the application does.

Cardinality: these metrics' labels are handler names and outcomes, bounded
by the handlers a process registers. The web process's queue gauges
(``django_dbworker.contrib.prometheus``) add six series for each distinct
queue name in the table (five statuses and the oldest pending age), with no
cap: queue names made up per tenant or per request grow the scrape without
bound.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from django_dbworker.outcomes import Outcome
from django_dbworker.periodic.handler import PeriodicHandler
from django_dbworker.registry import registry as handler_registry

try:
    import prometheus_client
except ImportError:  # the optional extra is not installed
    prometheus_client = None  # type: ignore[assignment]

logger = logging.getLogger("django_dbworker.metrics")

#: The block of ``running`` when metrics are off (a nullcontext is reusable).
_NOTHING = nullcontext()

#: Label value of the shared WorkItem claim loop's metrics.
WORK_ITEM_LOOP = "workitems"

#: Task durations from a millisecond to an hour.
TASK_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)
#: Claim and recovery queries: sub-millisecond to tens of seconds.
QUERY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0)


class WorkerMetrics:
    """The worker metrics of SPEC.md, registered on one registry."""

    def __init__(self, registry: Any = None) -> None:
        self.enabled = prometheus_client is not None
        self._task_children: dict[tuple[str, Outcome], tuple[list[Any], list[Any]]] = {}
        self._in_flight_children: dict[str, Any] = {}
        if not self.enabled:
            return
        pc = prometheus_client
        reg = registry if registry is not None else pc.REGISTRY
        kw: dict[str, Any] = {"registry": reg}
        self.poll_cycles = pc.Counter(
            "worker_poll_cycles_total",
            "Polling cycles (claim attempts) of a worker loop.",
            ["worker"],
            **kw,
        )
        self.claim_errors = pc.Counter(
            "worker_claim_errors_total", "Claims that raised an error.", ["worker"], **kw
        )
        self.claim_duration = pc.Histogram(
            "worker_claim_duration_seconds",
            "Time spent in one claim.",
            ["worker"],
            buckets=QUERY_BUCKETS,
            **kw,
        )
        self.recover_duration = pc.Histogram(
            "worker_recover_stale_duration_seconds",
            "Time spent in one stale-recovery pass.",
            ["worker"],
            buckets=QUERY_BUCKETS,
            **kw,
        )
        self.tasks = pc.Counter(
            "worker_tasks_total",
            "Finished attempts by outcome (succeeded, failed, retried, timeout).",
            ["worker", "status"],
            **kw,
        )
        self.task_duration = pc.Histogram(
            "worker_task_duration_seconds",
            "Duration of one attempt, by outcome.",
            ["worker", "status"],
            buckets=TASK_BUCKETS,
            **kw,
        )
        self.in_flight = pc.Gauge(
            "worker_tasks_in_flight",
            "Items being processed right now.",
            ["worker"],
            multiprocess_mode="livesum",
            **kw,
        )
        self.fenced = pc.Counter(
            "worker_fenced_total",
            "Outcomes discarded because a newer claim owned the row.",
            ["worker"],
            **kw,
        )
        self.stale_recovered = pc.Counter(
            "worker_stale_recovered_total", "Rows returned from crashed workers.", ["worker"], **kw
        )
        # Periodic handlers' runs are tasks too (worker_tasks_total counts
        # them); these name them apart, as SPEC.md lists them.
        self.periodic_runs = pc.Counter(
            "periodic_worker_runs_total",
            "Finished attempts of periodic handlers' slots, by outcome.",
            ["worker", "status"],
            **kw,
        )
        self.periodic_duration = pc.Histogram(
            "periodic_worker_run_duration_seconds",
            "Duration of one attempt of a periodic handler's slot, by outcome.",
            ["worker", "status"],
            buckets=TASK_BUCKETS,
            **kw,
        )
        self.periodic_skipped = pc.Counter(
            "periodic_worker_skipped_total",
            "Slots skipped because the previous run was still pending or running.",
            ["worker"],
            **kw,
        )
        # Flow control: ready rows a claim held back (reason "concurrency": no
        # free slot for their concurrency_key; "rate": over a rate limit).
        # Not attempts: the rows stay pending, untouched.
        self.throttled = pc.Counter(
            "worker_throttled_total",
            "Claim candidates held back by flow control, by reason (concurrency, rate).",
            ["worker", "reason"],
            **kw,
        )
        self.pruned = pc.Counter(
            "dbworker_pruned_total",
            "Finished rows deleted by the retention run, by status.",
            ["status"],
            **kw,
        )
        self.batches = pc.Counter(
            "dbworker_batches_completed_total",
            "Batches whose last item ended (their callback enqueued), by callback handler.",
            ["worker"],
            **kw,
        )
        self.abandoned = pc.Gauge(
            "worker_abandoned_threads",
            "Handler threads abandoned after their timeout that are still running.",
            multiprocess_mode="livesum",
            **kw,
        )

    # Each method is a no-op without prometheus_client; callers never check.

    def poll(self, worker: str) -> None:
        if self.enabled:
            self.poll_cycles.labels(worker).inc()

    def claim_error(self, worker: str) -> None:
        if self.enabled:
            self.claim_errors.labels(worker).inc()

    def claim_took(self, worker: str, seconds: float) -> None:
        if self.enabled:
            self.claim_duration.labels(worker).observe(seconds)

    def recover_took(self, worker: str, seconds: float) -> None:
        if self.enabled:
            self.recover_duration.labels(worker).observe(seconds)

    def recovered(self, worker: str, count: int) -> None:
        if self.enabled and count:
            self.stale_recovered.labels(worker).inc(count)

    def task_done(self, worker: str, status: Outcome, seconds: float) -> None:
        if not self.enabled:
            return
        if status is Outcome.FENCED:
            self.fenced.labels(worker).inc()
            return
        children = self._task_children.get((worker, status))
        if children is None:
            # labels() costs a lock and a few string operations per call; the
            # children are fixed once created, so each pair is looked up once
            # (and so is whether the handler is periodic).
            counters = [self.tasks.labels(worker, status)]
            histograms = [self.task_duration.labels(worker, status)]
            cls = handler_registry.get(worker)
            if cls is not None and issubclass(cls, PeriodicHandler):
                counters.append(self.periodic_runs.labels(worker, status))
                histograms.append(self.periodic_duration.labels(worker, status))
            children = self._task_children[(worker, status)] = (counters, histograms)
        for counter in children[0]:
            counter.inc()
        for histogram in children[1]:
            histogram.observe(seconds)

    def slot_skipped(self, worker: str) -> None:
        if self.enabled:
            self.periodic_skipped.labels(worker).inc()

    def pruned_rows(self, status: str, count: int) -> None:
        if self.enabled and count:
            self.pruned.labels(status).inc(count)

    def throttle(self, worker: str, reason: str, count: int = 1) -> None:
        """``count`` claims (or rows) of handler ``worker`` held back by its ``reason`` limit."""
        if self.enabled and count:
            self.throttled.labels(worker, reason).inc(count)

    def batch_completed(self, worker: str) -> None:
        if self.enabled:
            self.batches.labels(worker).inc()

    def abandoned_threads(self, count: int) -> None:
        if self.enabled:
            self.abandoned.set(count)

    def running(self, worker: str) -> AbstractContextManager[Any]:
        """``worker_tasks_in_flight{worker}`` raised for the block's duration.

        Entered once per attempt: the gauge's child is looked up once per
        handler (``labels()`` takes a lock and formats the labels each call)
        and the context manager is prometheus_client's own class, not a
        generator (about 3 µs an attempt, of a no-op job's 70).
        """
        if not self.enabled:
            return _NOTHING
        gauge = self._in_flight_children.get(worker)
        if gauge is None:
            gauge = self._in_flight_children[worker] = self.in_flight.labels(worker)
        return gauge.track_inprogress()


_default: WorkerMetrics | None = None
_default_lock = threading.Lock()


def default_metrics() -> WorkerMetrics:
    """The process-wide metrics on prometheus_client's default registry."""
    global _default
    with _default_lock:
        if _default is None:
            _default = WorkerMetrics()
        return _default


def multiprocess_mode() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def serve(port: int, addr: str) -> Any:
    """Serve ``/metrics`` from this process (raises OSError if the port is taken).

    In multiprocess mode the endpoint aggregates every process that shares
    ``PROMETHEUS_MULTIPROC_DIR``; serve it from one process only. Logs a
    warning when ``addr`` answers beyond loopback. Returns what
    ``prometheus_client.start_http_server`` returns (the server and its thread).
    """
    if prometheus_client is None:
        raise RuntimeError(
            "serving metrics needs prometheus_client: pip install 'django-dbworker[prometheus]'"
        )
    registry: Any = prometheus_client.REGISTRY
    if multiprocess_mode():
        from prometheus_client import multiprocess

        registry = prometheus_client.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    server = prometheus_client.start_http_server(port, addr=addr, registry=registry)
    if binds_beyond_loopback(addr):
        logger.warning(
            "Serving /metrics on %s:%s, beyond loopback: it has no authentication, so "
            "whoever reaches that port reads handler and queue names and counts. Bind "
            "127.0.0.1 (the default) or keep the port behind a firewall.",
            addr,
            port,
        )
    return server


def binds_beyond_loopback(addr: str) -> bool:
    """Whether a server bound to ``addr`` answers other hosts than this one.

    ``addr`` is resolved as the server resolves it; any address that is not
    loopback (the wildcards ``0.0.0.0`` and ``::`` included), or a name that
    does not resolve, counts as beyond.
    """
    host = addr.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        return True  # every interface
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError):
        return True
    for *_, sockaddr in infos:
        ip = ipaddress.ip_address(str(sockaddr[0]).partition("%")[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if not ip.is_loopback:
            return True
    return not infos


def mark_process_dead() -> None:
    """Drop this process's live gauges from the multiprocess directory."""
    if prometheus_client is not None and multiprocess_mode():
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]
