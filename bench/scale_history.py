"""Scale: claims with months of history in the table, and pruning it while workers run.

    .venv/bin/python bench/scale_history.py [--finished 10000000] [--items 20000]
        [--rate 50] [--stream-seconds 20] [--prune-batch 1000] [--prune-max-seconds 0]

Quick run: ``--finished 1000000``.

1. *Empty table*: W4's measure (``w4_big_table.py``: W1's active jobs/s,
   here ``--items`` no-op items drained by one ``run_workers --burst``),
   and a steady stream: one long-running ``run_workers`` (wake-ups on, the
   bench settings' ``POLL_INTERVAL``) and ``--rate`` items/s enqueued one
   per transaction for ``--stream-seconds``; per item, *start latency*
   (enqueue commit returned -> handler started, as W3) and *claim latency*
   (``claimed_at - created_at``, the rows' own DB-clock timestamps); and
   the claim statement's own execution time and the buffers it touches
   (``pg_stat_statements``, reset before each phase: calls, mean, max,
   shared blocks per call: the one figure the machine's load cannot move).
2. ``--finished`` finished rows (95% succeeded, 5% failed with a short
   traceback, five queues, ``finished_at`` spread over the past
   ``--finished`` / 2 seconds: 58 days at 10M) loaded with INSERT ... SELECT
   generate_series in chunks of a million, then VACUUM ANALYZE.
3. The same W1 drain and stream on the big table; the ratios.
4. ``dbworker_prune --older-than 1h --batch-size --prune-batch`` (the
   management command, as a user runs it: every finished row older than an
   hour, i.e. all of the history and none of the stream) while the stream
   runs: rows/s, the stream's latencies and the claim statement during the
   prune, and lock waits two ways: ``pg_locks.waitstart`` of every
   ungranted lock, sampled every 20 ms (the longest wait seen), and
   ``log_lock_waits`` with ``deadlock_timeout`` 100 ms (the server log's
   "still waiting" lines). ``--prune-max-seconds`` stops the prune (by its
   PID) after that long; the rate is then over what it deleted.
5. Table and index sizes before, after the prune, and after a plain VACUUM
   (with ``pgstattuple_approx``'s free space), and autovacuum's runs.

A durable cluster of its own (``.tmp/pg-scale-history.json``), stopped at
the end unless BENCH_KEEP_PG is set; every process stopped by its PID.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import psycopg
from common import machine, reset_table, setup_django, worker_command, worker_env
from scale_common import (
    commit_hash,
    server_log,
    start_cluster,
    stop_cluster,
    stop_processes,
    use_state,
)

TABLE = "django_dbworker_workitem"
CLAIM_PREFIX = "WITH c AS MATERIALIZED"

FILL_SQL = f"""
INSERT INTO {TABLE} (
    handler, queue, payload, status, priority, run_after, attempts, max_attempts,
    claimed_at, heartbeat_at, claimed_by, claim_token, finished_at, last_error, result,
    unique_key, trace_context, created_at, updated_at)
SELECT
    (ARRAY['noop','echo','record','urgent'])[1 + g %% 4],
    (ARRAY['default','echoes','urgent','emails','images'])[1 + g %% 5],
    jsonb_build_object('n', g),
    CASE WHEN g %% 20 = 0 THEN 'failed' ELSE 'succeeded' END,
    (g %% 7) - 3,
    now() - make_interval(secs => (%(n)s::bigint - g) / 2.0 + 3600),
    1, 3,
    now() - make_interval(secs => (%(n)s::bigint - g) / 2.0 + 3600),
    now() - make_interval(secs => (%(n)s::bigint - g) / 2.0 + 3600),
    'bighost:' || (g %% 10) || ':MainThread',
    NULL,
    now() - make_interval(secs => (%(n)s::bigint - g) / 2.0 + 3599),
    CASE WHEN g %% 20 = 0
         THEN 'ValueError: row ' || g || ' failed' || E'\\n\\n' || repeat('Traceback line ', 20)
         ELSE '' END,
    NULL, NULL, '{{}}'::jsonb,
    now() - make_interval(secs => (%(n)s::bigint - g) / 2.0 + 3600),
    now() - make_interval(secs => (%(n)s::bigint - g) / 2.0 + 3600)
FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS g
"""


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def sql(url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(query, params or None)
        return cur.fetchall() if cur.description else []


def sizes(url: str) -> dict[str, Any]:
    (row,) = sql(
        url,
        f"SELECT pg_relation_size('{TABLE}'), pg_indexes_size('{TABLE}'), "
        f"pg_total_relation_size('{TABLE}'), n_live_tup, n_dead_tup, autovacuum_count, "
        f"vacuum_count FROM pg_stat_user_tables WHERE relname = '{TABLE}'",
    )
    mib = 1024 * 1024
    return {
        "table_mib": row[0] / mib,
        "indexes_mib": row[1] / mib,
        "total_mib": row[2] / mib,
        "live_rows": row[3],
        "dead_rows": row[4],
        "autovacuum_count": row[5],
        "vacuum_count": row[6],
    }


def free_space(url: str) -> dict[str, float]:
    sql(url, "CREATE EXTENSION IF NOT EXISTS pgstattuple")
    (row,) = sql(
        url, f"SELECT approx_free_percent, dead_tuple_percent FROM pgstattuple_approx('{TABLE}')"
    )
    return {"free_percent": float(row[0]), "dead_tuple_percent": float(row[1])}


def claim_stats(url: str) -> dict[str, float]:
    """The claim statement(s) since the last reset: calls, mean and max ms, buffers per call.

    Buffers (shared blocks hit + read) per claim do not depend on the
    machine's load: they say how much of the table and its indexes one
    claim touches.
    """
    rows = sql(
        url,
        "SELECT sum(calls), sum(total_exec_time) / nullif(sum(calls), 0), max(max_exec_time), "
        "sum(shared_blks_hit + shared_blks_read)::float / nullif(sum(calls), 0) "
        "FROM pg_stat_statements WHERE query LIKE %s",
        CLAIM_PREFIX + "%",
    )
    calls, mean, peak, blocks = rows[0]
    return {
        "claim_calls": int(calls or 0),
        "claim_mean_ms": float(mean or 0),
        "claim_max_ms": float(peak or 0),
        "claim_buffers_per_call": float(blocks or 0),
    }


def reset_statements(url: str) -> None:
    sql(url, "SELECT pg_stat_statements_reset()")


def drain(items: int) -> float:
    """W1 on whatever the table holds: ``items`` no-op items, one process; active jobs/s."""
    from django.db.models import Max, Min

    from bench.benchapp.workers import BenchNoop
    from django_dbworker.models import WorkItem

    first_id = (WorkItem.objects.aggregate(m=Max("id"))["m"] or 0) + 1
    for start in range(0, items, 5000):
        BenchNoop.enqueue_many([None] * min(5000, items - start))
    proc = subprocess.Popen(worker_command("bench_noop", "--burst"), env=worker_env())
    try:
        code = proc.wait(600)
    finally:
        stop_processes([proc])
    mine = WorkItem.objects.filter(id__gte=first_id, handler="bench_noop")
    if code or mine.filter(status="succeeded").count() != items:
        raise SystemExit(f"the drain failed (exit {code})")
    span = mine.aggregate(first=Min("claimed_at"), last=Max("finished_at"))
    return items / (span["last"] - span["first"]).total_seconds()


class Stream:
    """``rate`` items/s of bench_latency, one per transaction, from a thread of their own."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.committed: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stream")

    def _run(self) -> None:
        from django.db import connection

        from bench.benchapp.workers import BenchLatency

        try:
            next_at = time.monotonic()
            while not self._stop.is_set():
                item = BenchLatency.enqueue(None)
                self.committed[item.pk] = time.time()
                next_at += 1.0 / self.rate
                self._stop.wait(max(0.0, next_at - time.monotonic()))
        finally:
            connection.close()

    def __enter__(self) -> Stream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def latencies(self, timeout: float = 120.0) -> dict[str, float]:
        """Wait for every streamed item to finish; their latencies' p50/p99/max (ms)."""
        from django_dbworker.models import WorkItem

        ids = list(self.committed)
        deadline = time.monotonic() + timeout
        while WorkItem.objects.filter(id__in=ids, status="succeeded").count() < len(ids):
            if time.monotonic() > deadline:
                raise SystemExit("streamed items did not finish")
            time.sleep(0.1)
        start, claim = [], []
        rows = WorkItem.objects.filter(id__in=ids).values_list(
            "id", "result", "claimed_at", "created_at"
        )
        for pk, started, claimed_at, created_at in rows:
            start.append((float(started) - self.committed[pk]) * 1000)
            claim.append((claimed_at - created_at).total_seconds() * 1000)
        return {
            "stream_items": len(ids),
            "start_p50_ms": statistics.median(start),
            "start_p99_ms": pct(start, 0.99),
            "start_max_ms": max(start),
            "claim_p50_ms": statistics.median(claim),
            "claim_p99_ms": pct(claim, 0.99),
            "claim_max_ms_rows": max(claim),
        }


def stream_phase(url: str, rate: float, seconds: float) -> dict[str, Any]:
    reset_statements(url)
    with Stream(rate) as stream:
        time.sleep(seconds)
    return {**stream.latencies(), **claim_stats(url)}


class LockSampler:
    """Every 20 ms: the longest-waiting ungranted lock (``pg_locks.waitstart``)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.longest_ms = 0.0
        self.longest: tuple[Any, ...] = ()
        self.samples = 0
        self.waiting_samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="locks")

    def _run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._stop.wait(0.02):
                rows = conn.execute(
                    "SELECT extract(epoch FROM clock_timestamp() - l.waitstart) * 1000, "
                    "l.locktype, l.mode, left(a.query, 80) FROM pg_locks l "
                    "JOIN pg_stat_activity a ON a.pid = l.pid "
                    "WHERE NOT l.granted AND l.waitstart IS NOT NULL"
                ).fetchall()
                self.samples += 1
                if rows:
                    self.waiting_samples += 1
                for row in rows:
                    if float(row[0]) > self.longest_ms:
                        self.longest_ms, self.longest = float(row[0]), row[1:]

    def __enter__(self) -> LockSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def lock_log_lines(offset: int) -> list[str]:
    with server_log().open(errors="replace") as fh:
        fh.seek(offset)
        return [line.strip() for line in fh if "still waiting" in line or "acquired" in line]


def fill(url: str, n: int) -> float:
    started = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        for lo in range(1, n + 1, 1_000_000):
            hi = min(n, lo + 999_999)
            conn.execute(FILL_SQL, {"n": n, "lo": lo, "hi": hi})
            print(
                f"  filled {hi:,} rows ({time.perf_counter() - started:,.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        conn.execute(f"VACUUM ANALYZE {TABLE}")
    return time.perf_counter() - started


def prune(url: str, batch: int, max_seconds: float, rate: float) -> dict[str, Any]:
    (before,) = sql(
        url, f"SELECT count(*) FROM {TABLE} WHERE finished_at < now() - interval '1 hour'"
    )
    log_offset = server_log().stat().st_size
    reset_statements(url)
    cmd = [
        sys.executable,
        "-m",
        "django",
        "dbworker_prune",
        "--older-than",
        "1h",
        "--batch-size",
        str(batch),
    ]
    with LockSampler(url) as locks, Stream(rate) as stream:
        started = time.perf_counter()
        proc = subprocess.Popen(
            cmd, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            try:
                out, err = proc.communicate(timeout=max_seconds or None)
                stopped = False
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGINT)
                out, err = proc.communicate(timeout=60)
                stopped = True
        finally:
            stop_processes([proc])
        elapsed = time.perf_counter() - started
    (after,) = sql(
        url, f"SELECT count(*) FROM {TABLE} WHERE finished_at < now() - interval '1 hour'"
    )
    deleted = before[0] - after[0]
    lines = lock_log_lines(log_offset)
    return {
        "prune_output": out.decode().strip() or err.decode().strip()[-300:],
        "prune_exit": proc.returncode,
        "prune_stopped_early": stopped,
        "prune_seconds": elapsed,
        "rows_deleted": deleted,
        "rows_per_second": deleted / elapsed,
        **{f"during_{k}": v for k, v in stream.latencies().items()},
        **{f"during_{k}": v for k, v in claim_stats(url).items()},
        "longest_lock_wait_ms": locks.longest_ms,
        "longest_lock_wait": list(locks.longest),
        "lock_samples": locks.samples,
        "lock_samples_with_a_wait": locks.waiting_samples,
        "log_lock_waits_lines": len(lines),
        "log_lock_waits_first": lines[:5],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--finished", type=int, default=10_000_000)
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--stream-seconds", type=float, default=20.0)
    parser.add_argument("--prune-batch", type=int, default=1000)
    parser.add_argument("--prune-max-seconds", type=float, default=0.0)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupted)
    use_state("history")
    result: dict[str, Any] = {
        "finished_rows": args.finished,
        "items": args.items,
        "rate": args.rate,
    }
    worker: list[subprocess.Popen[bytes]] = []

    def show(key: str, value: Any) -> None:
        result[key] = value
        print(f"  {key}: {json.dumps(value, default=str)}", file=sys.stderr, flush=True)

    try:
        url = start_cluster()
        setup_django(url)
        os.environ["DATABASE_URL"] = url
        print(
            json.dumps(
                {
                    "bench": "scale_history_run",
                    "commit": commit_hash(),
                    "argv": sys.argv,
                    "machine": machine(),
                }
            ),
            flush=True,
        )
        reset_table()
        show("empty_w1_items_per_second", drain(args.items))
        worker = [subprocess.Popen(worker_command("bench_latency"), env=worker_env())]
        stream_phase(url, args.rate, 3)  # warm-up: the worker is up and connected
        show("empty_stream", stream_phase(url, args.rate, args.stream_seconds))
        stop_processes(worker)
        reset_table()
        sql(url, f"VACUUM ANALYZE {TABLE}")
        show("fill_seconds", fill(url, args.finished))
        show("sizes_full", sizes(url))
        show("big_w1_items_per_second", drain(args.items))
        show("w4_ratio", result["big_w1_items_per_second"] / result["empty_w1_items_per_second"])
        worker = [subprocess.Popen(worker_command("bench_latency"), env=worker_env())]
        stream_phase(url, args.rate, 3)
        show("big_stream", stream_phase(url, args.rate, args.stream_seconds))
        show("prune", prune(url, args.prune_batch, args.prune_max_seconds, args.rate))
        stop_processes(worker)
        worker = []
        show("sizes_after_prune", sizes(url))
        started = time.perf_counter()
        sql(url, f"VACUUM {TABLE}")
        show("vacuum_seconds", time.perf_counter() - started)
        show("sizes_after_vacuum", sizes(url))
        show("free_space_after_vacuum", free_space(url))
        print(json.dumps({"bench": "scale_history", **result}, default=str), flush=True)
    finally:
        stop_processes(worker)
        stop_cluster()


if __name__ == "__main__":
    main()
