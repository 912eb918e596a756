"""Scale: W1 with 1, 2, 4 and 8 ``run_workers`` processes against one durable PostgreSQL.

    .venv/bin/python bench/scale_processes.py [--items 50000] [--processes 1,2,4,8]
        [--rounds 1] [--concurrency 8] [--stream-rate 200] [--stream-seconds 10]
        [--stream-only]

For each process count: ``--items`` no-op items enqueued in bulk (not
timed), then that many ``run_workers --burst`` processes drain them. Per
run it reports jobs/s *whole* (spawn to the last exit) and *active* (first
``claimed_at`` to last ``finished_at``, as ``w1_throughput.py``), the
database's CPU seconds over the drain (per job and as a share of the wall
time), and what the drain cost the database per job: commits and
rollbacks (``pg_stat_database``; the workers have exited, so their counts
are flushed), statements (``pg_stat_statements``: all, and without
BEGIN/COMMIT/SAVEPOINT/RELEASE), rows inserted/updated/deleted/returned.
Then a steady stream to each process count (``--stream-rate`` items/s for
``--stream-seconds``, each enqueued in its own transaction, to
long-running workers): the same costs per job, enqueue included, where
no claim finds more than a few rows, with its claims per job (claim statements
that ran, found rows or not, from ``pg_stat_statements``) and its pick-up latency
(``claimed_at - created_at``, the database's clock, p50/p99). ``--stream-only``
leaves out the drains. Commits are also counted once the workers exited: a
LISTEN connection reads each notification in a transaction of its own, which
its backend reports only when it next runs a command or exits. Then the raw ceiling
(``raw_ceiling.py``) on the same cluster, the machine's commit rate as the
other benchmarks state it.

Uses a durable cluster of its own (``.tmp/pg-scale-processes.json``, see
``scale_common.py``) and stops it at the end (unless BENCH_KEEP_PG is set).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import machine, reset_table, setup_django, worker_command, worker_env
from scale_common import (
    client_backends,
    commit_hash,
    snapshot,
    start_cluster,
    stop_cluster,
    stop_processes,
    use_state,
)

BENCH = Path(__file__).resolve().parent


def drain(url: str, items: int, processes: int, concurrency: int) -> dict[str, object]:
    from django.db.models import Max, Min

    from bench.benchapp.workers import BenchNoop
    from django_dbworker.models import WorkItem

    reset_table()
    for start in range(0, items, 5000):
        BenchNoop.enqueue_many([None] * min(5000, items - start))
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE django_dbworker_workitem")
    connection.close()  # its counts flushed and out of the way
    before = snapshot(url)
    spawned = time.perf_counter()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs = [
            subprocess.Popen(
                worker_command("bench_noop", "--burst", "--concurrency", str(concurrency)),
                env=worker_env(),
            )
            for _ in range(processes)
        ]
        codes = [p.wait() for p in procs]
    finally:
        stop_processes(procs)
    whole = time.perf_counter() - spawned
    after = snapshot(url)
    delta = after.delta(before)
    done = WorkItem.objects.filter(status="succeeded").count()
    span = WorkItem.objects.aggregate(first=Min("claimed_at"), last=Max("finished_at"))
    active = (span["last"] - span["first"]).total_seconds()
    if done != items or any(codes):
        raise SystemExit(f"not every item succeeded: {done} of {items}, exit codes {codes}")
    per = float(items)
    return {
        "processes": processes,
        "concurrency": concurrency,
        "items": items,
        "whole_seconds": whole,
        "items_per_second_whole": items / whole,
        "active_seconds": active,
        "items_per_second_active": items / active,
        "server_cpu_seconds": delta["server_cpu_seconds"],
        "server_cpu_ms_per_job": delta["server_cpu_seconds"] * 1000 / per,
        "server_cpu_share_of_wall": delta["server_cpu_seconds"] / whole,
        "commits_per_job": delta["xact_commit"] / per,
        "rollbacks_per_job": delta["xact_rollback"] / per,
        "statements_per_job": delta["statements"] / per,
        "queries_per_job": (delta["statements"] - delta["statements_control"]) / per,
        "wal_bytes_per_job": delta["wal_bytes"] / per,
        "rows_inserted_per_job": delta["tup_inserted"] / per,
        "rows_updated_per_job": delta["tup_updated"] / per,
        "rows_deleted_per_job": delta["tup_deleted"] / per,
        "rows_returned_per_job": delta["tup_returned"] / per,
        "top_statements_per_job": [(q[:160], round(n / per, 3)) for q, n in delta["top"]],
    }


def stream(url: str, processes: int, rate: float, seconds: float) -> dict[str, object]:
    """A steady stream: ``rate`` items/s, one per transaction, to long-running workers."""
    from bench.benchapp.workers import BenchNoop
    from django_dbworker.models import WorkItem

    reset_table()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs = [
            subprocess.Popen(worker_command("bench_noop"), env=worker_env())
            for _ in range(processes)
        ]
        deadline = time.monotonic() + 120
        while client_backends(url) < 2 * processes + 1:  # theirs, and this one's
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit("the stream's workers did not start")
            time.sleep(0.2)
        time.sleep(3)
        before = snapshot(url)
        count, next_at = 0, time.monotonic()
        end = next_at + seconds
        connections = 0
        while time.monotonic() < end:
            BenchNoop.enqueue(None)  # autocommit: its own transaction
            count += 1
            if count % 100 == 0:  # every process has run jobs: its threads are connected
                connections = max(connections, client_backends(url) - 1)
            next_at += 1.0 / rate
            time.sleep(max(0.0, next_at - time.monotonic()))
        while WorkItem.objects.filter(status="succeeded").count() < count:
            if time.monotonic() > end + 60:
                raise SystemExit("streamed items did not finish")
            time.sleep(0.05)
        after = snapshot(url)
    finally:
        stop_processes(procs)
    # A backend counts its transactions when it next goes idle after a command, or exits:
    # a LISTEN connection's reads of notifications (a transaction each) show only now.
    time.sleep(1.0)
    exited = snapshot(url).delta(before)
    delta = after.delta(before)
    per = float(count)
    pickup = pickup_ms()
    return {
        "mode": "stream",
        "claims_per_job": delta["claims"] / per,
        "pickup_p50_ms": pickup[len(pickup) // 2],
        "pickup_p99_ms": pickup[min(len(pickup) - 1, len(pickup) * 99 // 100)],
        "processes": processes,
        "connections_per_process": connections / processes,
        "rate": rate,
        "items": count,
        "seconds": delta["seconds"],
        "server_cpu_ms_per_job": delta["server_cpu_seconds"] * 1000 / per,
        "server_cpu_share_of_wall": delta["server_cpu_seconds"] / delta["seconds"],
        "commits_per_job": delta["xact_commit"] / per,
        "commits_per_job_counted_at_exit": exited["xact_commit"] / per,
        "statements_per_job": delta["statements"] / per,
        "queries_per_job": (delta["statements"] - delta["statements_control"]) / per,
        "wal_bytes_per_job": delta["wal_bytes"] / per,
        "top_statements_per_job": [(q[:160], round(n / per, 3)) for q, n in delta["top"]],
    }


def pickup_ms() -> list[float]:
    """The streamed rows' ``claimed_at - created_at`` in milliseconds, sorted."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXTRACT(EPOCH FROM claimed_at - created_at) * 1000 "
            "FROM django_dbworker_workitem ORDER BY 1"
        )
        return [float(row[0]) for row in cursor.fetchall()] or [0.0]


def raw_ceiling(url: str) -> dict[str, object]:
    env = dict(os.environ, DATABASE_URL=url)
    out = subprocess.run(
        [sys.executable, str(BENCH / "raw_ceiling.py")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[0])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=50_000)
    parser.add_argument("--processes", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--no-raw", action="store_true", help="skip the raw ceiling")
    parser.add_argument(
        "--stream-rate", type=float, default=200.0, help="items/s of the stream (0: none)"
    )
    parser.add_argument("--stream-seconds", type=float, default=10.0)
    parser.add_argument("--stream-only", action="store_true", help="skip the drains")
    args = parser.parse_args()
    counts = [int(p) for p in args.processes.split(",")]
    use_state("processes")
    try:
        url = start_cluster()
        setup_django(url)
        header = {"commit": commit_hash(), "argv": sys.argv, "machine": machine()}
        print(json.dumps({"bench": "scale_processes_run", **header}), flush=True)
        results = []
        for round_no in range(0 if args.stream_only else args.rounds):
            for count in counts:
                result = drain(url, args.items, count, args.concurrency)
                result["round"] = round_no + 1
                results.append(result)
                print(json.dumps({"bench": "scale_processes", **result}), flush=True)
                print(
                    f"  {count} processes: {result['items_per_second_whole']:,.0f} jobs/s whole, "
                    f"{result['items_per_second_active']:,.0f} active; "
                    f"server CPU {result['server_cpu_ms_per_job']:.3f} ms/job "
                    f"({result['server_cpu_share_of_wall']:.2f} cores); "
                    f"{result['commits_per_job']:.3f} commits, "
                    f"{result['statements_per_job']:.2f} statements "
                    f"({result['queries_per_job']:.2f} queries) per job",
                    file=sys.stderr,
                    flush=True,
                )
        for count in counts if args.stream_rate else ():
            result = stream(url, count, args.stream_rate, args.stream_seconds)
            print(json.dumps({"bench": "scale_processes", **result}), flush=True)
            print(
                f"  stream {args.stream_rate:g}/s to {count} processes: "
                f"server CPU {result['server_cpu_ms_per_job']:.3f} ms/job; "
                f"{result['commits_per_job']:.3f} commits "
                f"({result['commits_per_job_counted_at_exit']:.3f} counted at exit), "
                f"{result['statements_per_job']:.2f} statements "
                f"({result['queries_per_job']:.2f} queries), "
                f"{result['claims_per_job']:.2f} claims per job; pick-up p50 "
                f"{result['pickup_p50_ms']:.1f} ms, p99 {result['pickup_p99_ms']:.1f} ms",
                file=sys.stderr,
                flush=True,
            )
        if not args.no_raw:
            raw = raw_ceiling(url)
            print(json.dumps(raw), flush=True)
            print(
                f"  raw ceiling: claim/complete batch 1 "
                f"{raw['claim_complete_batch1_per_second']:,.0f} rows/s (two commits per row), "
                f"single INSERT + commit {raw['single_insert_per_second']:,.0f}/s",
                file=sys.stderr,
            )
    finally:
        stop_cluster()


if __name__ == "__main__":
    main()
