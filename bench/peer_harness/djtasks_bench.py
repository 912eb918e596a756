"""django-tasks-db (its db_worker) through W1/W2/W3 (run with its own venv's python)."""

from __future__ import annotations

import sys
import time

import djtasks_app
from django.core.management import call_command
from django.db import connection, transaction
from django.db.models import Max, Min
from django_tasks_db.models import DBTaskResult
from peer_common import emit, latency_run


def commits() -> int:
    """Transactions committed in this database so far (all sessions)."""
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            # Server-wide, as bench/w1_throughput.py counts ours (the benchmark
            # server serves nothing else): explicit COMMITs only, so a write
            # in autocommit mode is not counted.
            cursor.execute("SHOW GLOBAL STATUS LIKE 'Com_commit'")
            return int(cursor.fetchone()[1])
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )
        return int(cursor.fetchone()[0])


def main() -> None:
    mode = sys.argv[1]
    if mode == "worker":
        call_command("db_worker", "--no-startup-delay", "--no-reload")
        return
    call_command("migrate", verbosity=0)
    if mode == "w1":
        # Enqueued with the task API in one transaction (not timed: Django's
        # API has no bulk enqueue), then one db_worker --batch drains them.
        # "w1 ITEMS analyze": ANALYZE the table before the worker starts.
        items = int(sys.argv[2])
        enqueue_started = time.perf_counter()
        with transaction.atomic():
            for _ in range(items):
                djtasks_app.noop.enqueue()
        enqueue_seconds = time.perf_counter() - enqueue_started
        analyze = sys.argv[3:4] == ["analyze"]
        if analyze:
            # Planner statistics as autovacuum would leave them. Without them,
            # right after a burst of enqueues, PostgreSQL takes the ready set
            # for a handful of rows and sorts all of it for every claim.
            with connection.cursor() as cursor:
                table = DBTaskResult._meta.db_table
                if connection.vendor == "mysql":
                    cursor.execute(f"ANALYZE TABLE {table}")
                    cursor.fetchall()
                else:
                    cursor.execute(f"ANALYZE {table}")
        commits_before = commits()
        started = time.perf_counter()
        call_command("db_worker", "--batch", "--no-startup-delay", "--no-reload", verbosity=0)
        wall = time.perf_counter() - started
        # The worker ran on this process's connection: end that session so
        # that its commit counts reach pg_stat_database (PostgreSQL).
        connection.close()
        time.sleep(0.5)
        worker_commits = commits() - commits_before
        span = DBTaskResult.objects.aggregate(first=Min("started_at"), last=Max("finished_at"))
        active = (span["last"] - span["first"]).total_seconds()
        emit(
            bench="w1_throughput",
            items=items,
            analyzed=analyze,
            succeeded=DBTaskResult.objects.successful().count(),
            items_per_second=items / wall,
            active_seconds=active,
            items_per_second_active=items / active,
            commits_per_item=worker_commits / items,
            enqueue_in_one_transaction_per_second=items / enqueue_seconds,
        )
    elif mode == "w2":
        single = int(sys.argv[2])
        started = time.perf_counter()
        for _ in range(single):
            djtasks_app.noop.enqueue()
        emit(
            bench="w2_enqueue",
            single_per_second=single / (time.perf_counter() - started),
            many_per_second=None,
        )
    elif mode == "w3":
        counter = iter(range(10**9))

        def enqueue() -> str:
            key = f"k{next(counter)}"
            djtasks_app.noop.enqueue(key=key)
            return key

        latency_run(enqueue, int(sys.argv[2]), float(sys.argv[3]), [__file__, "worker"])


if __name__ == "__main__":
    main()
