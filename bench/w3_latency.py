"""W3: wake-up latency, enqueue commit to handler start, on an idle worker.

    .venv/bin/python bench/w3_latency.py [--items 200] [--rate 20]

Starts one ``run_workers`` with a long poll interval (so only LISTEN/NOTIFY
can wake it quickly), then enqueues ``--items`` items one at a time, each in
its own transaction, ``--rate`` per second. The handler returns the time it
started; latency = that minus the time the enqueuing commit returned.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

from common import (
    report,
    reset_table,
    setup_django,
    start_postgres,
    stop_postgres,
    worker_command,
    worker_env,
)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0)
    args = parser.parse_args()
    url = start_postgres()
    try:
        setup_django(url)
        from bench.benchapp.workers import BenchLatency
        from django_dbworker.models import WorkItem

        reset_table()
        proc = subprocess.Popen(
            worker_command("bench_latency", "--interval", "30"), env=worker_env()
        )
        # Wait until the worker is up: one warm-up item goes through.
        BenchLatency.enqueue(None)
        deadline = time.monotonic() + 60
        while not WorkItem.objects.filter(status="succeeded").exists():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the worker did not start")
            time.sleep(0.05)
        reset_table()
        committed: dict[int, float] = {}
        interval = 1.0 / args.rate
        next_at = time.monotonic()
        for _ in range(args.items):
            item = BenchLatency.enqueue(None)  # autocommit: its own transaction
            committed[item.pk] = time.time()
            next_at += interval
            time.sleep(max(0.0, next_at - time.monotonic()))
        deadline = time.monotonic() + 60
        while WorkItem.objects.filter(status="succeeded").count() < args.items:
            if time.monotonic() > deadline:
                raise SystemExit("items did not finish")
            time.sleep(0.05)
        proc.terminate()
        proc.wait(30)
        latencies = [
            (started - committed[pk]) * 1000.0
            for pk, started in WorkItem.objects.values_list("pk", "result")
        ]
        report(
            "w3_latency",
            {
                "items": args.items,
                "rate_per_second": args.rate,
                "p50_ms": statistics.median(latencies),
                "p99_ms": percentile(latencies, 0.99),
                "max_ms": max(latencies),
                "min_ms": min(latencies),
            },
        )
    finally:
        stop_postgres()


if __name__ == "__main__":
    main()
