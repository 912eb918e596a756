"""W6: urgent work behind a backlog, enqueue commit to handler start.

    .venv/bin/python bench/w6_priority.py [--backlog 20000] [--urgent 40] [--rate 10]

Enqueues ``--backlog`` priority-0 items that sleep ``--job-ms`` each (not
timed), starts one ``run_workers`` at its default settings, and once it is
draining the backlog enqueues ``--urgent`` priority-10 items one at a time,
each in its own transaction, ``--rate`` per second (a password-reset e-mail
during a newsletter). Their handler returns the time it started; latency =
that minus the time the enqueuing commit returned. The backlog is not
waited for: the worker is stopped once the urgent items ran.

``--stale-stats`` makes the table's statistics wrong the way autovacuum
can, for certain: the columns analyzed with an earlier backlog, then an
ANALYZE while the backlog's enqueue_many is uncommitted, which counts the
table's pages but none of its rows (the planner then expects one pending
row). W6's slow mode in some run_all runs was this state, reached by chance.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from collections.abc import Callable

from common import (
    report,
    reset_table,
    setup_django,
    start_postgres,
    stop_postgres,
    worker_command,
    worker_env,
)
from w3_latency import percentile


def stale_statistics(enqueue: Callable[[], object]) -> None:
    """Run ``enqueue`` so that the table's statistics count its pages but none of its rows."""
    import psycopg
    from django.db import connection, transaction

    enqueue()
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE django_dbworker_workitem")
    reset_table()
    with transaction.atomic():
        enqueue()
        params = connection.get_connection_params()
        with psycopg.connect(**params, autocommit=True) as other:
            other.execute("ANALYZE django_dbworker_workitem")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backlog", type=int, default=20_000)
    parser.add_argument("--job-ms", type=float, default=10.0)
    parser.add_argument("--urgent", type=int, default=40)
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--stale-stats", action="store_true")
    args = parser.parse_args()
    url = start_postgres()
    try:
        setup_django(url)
        from bench.benchapp.workers import BenchLatency, BenchSleep
        from django_dbworker.models import WorkItem

        backlog = [{"seconds": args.job_ms / 1000.0}] * args.backlog
        reset_table()
        if args.stale_stats:
            stale_statistics(lambda: BenchSleep.enqueue_many(backlog, priority=0))
        else:
            BenchSleep.enqueue_many(backlog, priority=0)
        proc = subprocess.Popen(worker_command("bench_sleep", "bench_latency"), env=worker_env())
        # Draining: a few hundred backlog items done, the buffer sized from them.
        deadline = time.monotonic() + 60
        while WorkItem.objects.filter(status="succeeded").count() < 300:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the worker did not start draining")
            time.sleep(0.05)
        committed: dict[int, float] = {}
        interval = 1.0 / args.rate
        next_at = time.monotonic()
        for _ in range(args.urgent):
            item = BenchLatency.enqueue(None, priority=10)  # autocommit: its own transaction
            committed[item.pk] = time.time()
            next_at += interval
            time.sleep(max(0.0, next_at - time.monotonic()))
        urgent = WorkItem.objects.filter(handler="bench_latency")
        deadline = time.monotonic() + 120
        while urgent.filter(status="succeeded").count() < args.urgent:
            if time.monotonic() > deadline:
                raise SystemExit("the urgent items did not finish")
            time.sleep(0.05)
        left = WorkItem.objects.filter(handler="bench_sleep", status="pending").count()
        proc.terminate()
        proc.wait(60)
        rows = urgent.values_list("pk", "result", "claimed_at")
        latencies = [(started - committed[pk]) * 1000.0 for pk, started, _ in rows]
        # Where the time goes: commit -> the claim statement's start (the
        # wake-up and the claim loop), then that -> the handler's first line
        # (the claim's round trip and commit, and the wait for a free thread:
        # the --concurrency threads are all busy with backlog items).
        to_claim = [(claimed.timestamp() - committed[pk]) * 1000.0 for pk, _, claimed in rows]
        to_start = [(started - claimed.timestamp()) * 1000.0 for _, started, claimed in rows]
        report(
            "w6_priority",
            {
                "backlog": args.backlog,
                "stale_stats": args.stale_stats,
                "job_ms": args.job_ms,
                "urgent": args.urgent,
                "backlog_left_pending": left,
                "p50_ms": statistics.median(latencies),
                "p99_ms": percentile(latencies, 0.99),
                "max_ms": max(latencies),
                "min_ms": min(latencies),
                "to_claim_p50_ms": statistics.median(to_claim),
                "claim_to_start_p50_ms": statistics.median(to_start),
            },
        )
    finally:
        stop_postgres()


if __name__ == "__main__":
    main()
