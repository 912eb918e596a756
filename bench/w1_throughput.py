"""W1: throughput of run_workers on pre-enqueued no-op items.

    .venv/bin/python bench/w1_throughput.py [--items 10000] [--processes 1]

Enqueues ``--items`` no-op items in bulk (not timed), starts ``--processes``
``run_workers --burst`` processes and reports two rates:

*whole* (``items_per_second_whole``): spawning the processes to the last
one's exit, every item succeeded; includes the interpreter's, Django's and
the worker's start-up and shutdown (what a cron- or autoscaler-started
drain pays).

*active* (``items_per_second_active``): the first item's ``claimed_at`` to
the last item's ``finished_at``, the rows' own timestamps (start-up
excluded).

And the CPU each item cost: ``worker_cpu_us_per_item``, the worker
processes' user + system time (``getrusage`` of the waited-for children,
start-up included), and ``database_cpu_us_per_item``, the PostgreSQL
server's (``/proc`` of the postmaster and its children, the exited backends
included). On a machine shared with other work these are the figures to
trust: a busy neighbour stretches the rates, not the CPU an item costs.

``--also NAME`` (repeatable): the workers serve that handler too, with no
items of its own; ``--also bench_keyed`` is a project where one handler
declares a ``concurrency_limit``, which makes every claim of the worker keyed.

``--hold-xmin``: another connection holds a snapshot open (REPEATABLE READ,
``txid_current()``) from before the enqueue until the workers are done, as a
long report or a forgotten ``psql`` session would: no row the run updates or
deletes can be vacuumed meanwhile, and a claim that walks dead rows slows
down as they pile up.

bench/peer_harness/pgqueuer_bench.py reports the same two for pgqueuer.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from typing import Any

from common import (
    children_cpu_seconds,
    commits,
    database_cpu_seconds,
    report,
    reset_table,
    setup_django,
    start_postgres,
    stop_postgres,
    wait_for_backends_to_exit,
    worker_command,
    worker_env,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--keep-rows",
        action="store_true",
        help="do not empty the table first (W4 keeps its finished rows)",
    )
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        help="another handler the workers serve (with no items), e.g. bench_keyed",
    )
    parser.add_argument(
        "--hold-xmin",
        action="store_true",
        help="hold a snapshot open in another connection for the whole run",
    )
    args = parser.parse_args()
    url = start_postgres()
    try:
        setup_django(url)
        from django.db.models import Max, Min

        from bench.benchapp.workers import BenchNoop
        from django_dbworker.models import WorkItem

        if not args.keep_rows:
            reset_table()
        holder = _hold_xmin(url) if args.hold_xmin else None
        before = WorkItem.objects.filter(status="succeeded").count()
        commits_before = commits()
        workers_cpu_before = children_cpu_seconds()
        database_cpu_before = database_cpu_seconds()
        for start in range(0, args.items, 5000):
            BenchNoop.enqueue_many([None] * min(5000, args.items - start))
        spawned = time.perf_counter()
        procs = [
            subprocess.Popen(
                worker_command(
                    "bench_noop", *args.also, "--burst", "--concurrency", str(args.concurrency)
                ),
                env=worker_env(),
            )
            for _ in range(args.processes)
        ]
        codes = [p.wait() for p in procs]
        whole = time.perf_counter() - spawned
        if holder is not None:
            holder.close()  # before the backends' count: it is one of them
        workers_cpu = children_cpu_seconds() - workers_cpu_before
        # Once the workers' backends have exited, their counts are flushed
        # and their CPU time is the postmaster's (reaped children).
        wait_for_backends_to_exit()
        database_cpu_after = database_cpu_seconds()
        worker_commits = commits() - commits_before
        done = WorkItem.objects.filter(status="succeeded").count() - before
        span = WorkItem.objects.filter(handler="bench_noop").aggregate(
            first=Min("claimed_at"), last=Max("finished_at")
        )
        active = (span["last"] - span["first"]).total_seconds()
        report(
            "w1_throughput",
            {
                "items": args.items,
                "processes": args.processes,
                "concurrency": args.concurrency,
                "also": args.also,
                "hold_xmin": args.hold_xmin,
                "succeeded": done,
                "exit_codes": codes,
                "whole_seconds": whole,
                "items_per_second_whole": args.items / whole,
                "active_seconds": active,
                "items_per_second_active": args.items / active,
                "commits_per_item": worker_commits / args.items,
                "worker_cpu_us_per_item": workers_cpu * 1e6 / args.items,
                "database_cpu_us_per_item": (
                    None
                    if database_cpu_before is None or database_cpu_after is None
                    else (database_cpu_after - database_cpu_before) * 1e6 / args.items
                ),
            },
        )
        if done != args.items or any(codes):
            raise SystemExit("not every item succeeded")
    finally:
        stop_postgres()


def _hold_xmin(url: str) -> Any:
    """A connection whose open snapshot holds the xmin horizon back until it is closed."""
    import psycopg

    conn = psycopg.connect(url)
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    conn.execute("SELECT txid_current()")
    return conn


if __name__ == "__main__":
    main()
