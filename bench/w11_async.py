"""W11: async handlers, many in flight on few connections, against the same work on threads.

    .venv/bin/python bench/w11_async.py [--items 2000] [--async-concurrency 1000]
        [--sync-items 200] [--noop-items 10000] [--latency-items 200]

Legs, one ``run_workers`` process each, on the durable benchmark PostgreSQL:

``async_sleep``
    ``--items`` items whose handler does ``await asyncio.sleep(1)`` (an
    ``async def handle``), one ``run_workers --burst --async-concurrency N``:
    completed per second (the rows' first ``claimed_at`` to last
    ``finished_at``), and the most database connections the worker held at
    once (``pg_stat_activity``, sampled every 50 ms: every client backend of
    the database but the benchmark's own).
``sync_sleep``
    the same, ``time.sleep(1)`` in a plain ``def handle``, at the default
    CONCURRENCY (8): ``--sync-items`` of them (8 a second, whatever the count).
``w1_async`` / ``w1_sync``
    ``--noop-items`` no-op items (async, then sync), ``--burst``: completed per second.
``w3_async`` / ``w3_sync``
    an idle worker; ``--latency-items`` no-op items enqueued one at a time at
    20/s; enqueue commit to handler start (p50, p99), as bench/w3_latency.py.
``procrastinate`` / ``pgqueuer`` (``--peers``)
    the ``async_sleep`` leg's items as the peers' ``await asyncio.sleep(1)``
    jobs, each peer in its own virtual environment and database
    (bench/peers.py, bench/peer_harness): procrastinate's worker at
    ``concurrency`` = ``--async-concurrency`` (its default is 1; its docs
    say to raise it for I/O-bound work), pgqueuer's ``pgq run --mode
    drain`` at its CLI's defaults (no concurrency limit). Their connections
    count the harness's enqueuing connection too.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import threading
import time
from typing import Any

from common import (
    report,
    reset_table,
    settle_table,
    setup_django,
    start_postgres,
    stop_postgres,
    worker_command,
    worker_env,
)

CONNECTIONS = """
    SELECT count(*) FROM pg_stat_activity
    WHERE datname = current_database() AND backend_type = 'client backend'
      AND pid <> pg_backend_pid()
"""


class ConnectionSampler(threading.Thread):
    """The most client connections to the database (the benchmark's own left out)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.most = 0
        self.stop = threading.Event()

    def run(self) -> None:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self.stop.wait(0.05):
                row = conn.execute(CONNECTIONS).fetchone()
                self.most = max(self.most, int(row[0]) if row else 0)


def _database_url() -> str:
    from django.db import connection

    s = connection.settings_dict
    return f"postgresql://{s['USER']}@{s['HOST']}:{s['PORT']}/{s['NAME']}"


def burst(handler: str, payloads: list[Any], *flags: str) -> dict[str, float]:
    """Enqueue ``payloads``, run one burst worker, report its rate and connections."""
    from django.db.models import Max, Min

    from django_dbworker.models import WorkItem

    reset_table()
    from django_dbworker import enqueue_many

    for start in range(0, len(payloads), 5000):
        enqueue_many(handler, payloads[start : start + 5000])
    settle_table()
    sampler = ConnectionSampler(_database_url())
    sampler.start()
    spawned = time.perf_counter()
    proc = subprocess.run(worker_command(handler, "--burst", *flags), env=worker_env())
    whole = time.perf_counter() - spawned
    sampler.stop.set()
    sampler.join(5)
    if proc.returncode != 0:
        raise SystemExit(f"run_workers exited {proc.returncode}")
    done = WorkItem.objects.filter(status="succeeded")
    if done.count() != len(payloads):
        raise SystemExit(f"{done.count()} of {len(payloads)} items succeeded")
    span = done.aggregate(first=Min("claimed_at"), last=Max("finished_at"))
    active = (span["last"] - span["first"]).total_seconds()
    return {
        "items": len(payloads),
        "items_per_second": len(payloads) / active,
        "items_per_second_whole": len(payloads) / whole,
        "max_connections": sampler.most,
    }


def latency(handler: str, items: int, rate: float = 20.0) -> dict[str, float]:
    """W3 on ``handler`` (its result: the time it started), one idle worker."""
    from django_dbworker import enqueue
    from django_dbworker.models import WorkItem

    reset_table()
    proc = subprocess.Popen(worker_command(handler, "--interval", "30"), env=worker_env())
    try:
        enqueue(handler, None)
        deadline = time.monotonic() + 60
        while not WorkItem.objects.filter(status="succeeded").exists():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the worker did not start")
            time.sleep(0.05)
        reset_table()
        committed: dict[int, float] = {}
        next_at = time.monotonic()
        for _ in range(items):
            item = enqueue(handler, None)
            committed[item.pk] = time.time()
            next_at += 1.0 / rate
            time.sleep(max(0.0, next_at - time.monotonic()))
        deadline = time.monotonic() + 60
        while WorkItem.objects.filter(status="succeeded").count() < items:
            if time.monotonic() > deadline:
                raise SystemExit("items did not finish")
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(30)
    ms = sorted(
        (float(started) - committed[pk]) * 1000.0
        for pk, started in WorkItem.objects.values_list("pk", "result")
    )
    return {"p50_ms": statistics.median(ms), "p99_ms": ms[min(len(ms) - 1, round(0.99 * len(ms)))]}


def peer(url: str, name: str, items: int, *extra: str) -> dict[str, Any]:
    """A peer's W11 run (its harness's ``w11`` mode), its connections sampled meanwhile."""
    import peers

    packages, script = peers.PEERS[name]
    python = peers.venv_python(name, packages)
    database = peers.fresh_database(url, name)
    sampler = ConnectionSampler(database)
    sampler.start()
    try:
        result = peers.run(python, script, database, "w11", str(items), *extra)
    finally:
        sampler.stop.set()
        sampler.join(5)
    return {
        "items": items,
        "items_per_second": result["items_per_second"],
        "items_per_second_whole": result.get("items_per_second_whole", 0.0),
        "max_connections": sampler.most,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--async-concurrency", type=int, default=1000)
    parser.add_argument("--sync-items", type=int, default=200)
    parser.add_argument("--noop-items", type=int, default=10_000)
    parser.add_argument("--latency-items", type=int, default=200)
    parser.add_argument("--peers", action="store_true", help="procrastinate and pgqueuer too")
    args = parser.parse_args()
    url = start_postgres()
    try:
        setup_django(url)
        second = {"seconds": 1}
        flags = ("--async-concurrency", str(args.async_concurrency))
        legs = {
            "async_sleep": lambda: burst("bench_async", [second] * args.items, *flags),
            "sync_sleep": lambda: burst("bench_noop", [{"ms": 1000}] * args.sync_items),
            "w1_async": lambda: burst("bench_async", [None] * args.noop_items, *flags),
            "w1_sync": lambda: burst("bench_noop", [None] * args.noop_items),
            "w3_async": lambda: latency("bench_async", args.latency_items),
            "w3_sync": lambda: latency("bench_latency", args.latency_items),
        }
        if args.peers:
            legs["procrastinate"] = lambda: peer(url, "procrastinate", args.items, flags[1])
            legs["pgqueuer"] = lambda: peer(url, "pgqueuer", args.items)
        for name, leg in legs.items():
            report(f"w11_{name}", {**leg(), "async_concurrency": args.async_concurrency})
    finally:
        stop_postgres()


if __name__ == "__main__":
    main()
