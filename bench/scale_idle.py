"""Scale: what idle ``run_workers`` processes cost the database.

    .venv/bin/python bench/scale_idle.py [--workers 50] [--window 30] [--settle 15]
        [--handlers bench_noop]

Starts ``--workers`` long-running ``run_workers`` processes (every handler
of the bench app, or only ``--handlers``; the bench settings'
``POLL_INTERVAL``; no work in the table), waits until their connections
are all open and steady and ``--settle`` seconds more,
then counts what they do in ``--window`` seconds: statements
(``pg_stat_statements``, exact), transactions (``pg_stat_database``
``xact_commit``; idle backends flush it every ~10 s, so the window should be
well over that), the server's CPU, the client connections open
(``pg_stat_activity``) and the processes' memory (VmRSS). The same window
with no worker running is measured first: the baseline is subtracted.

Reported per process per ``POLL_INTERVAL``, and the statements that make
it up. Every process is stopped by its PID at the end, on Ctrl-C and on
any error. A durable cluster of its own (``.tmp/pg-scale-idle.json``),
stopped at the end unless BENCH_KEEP_PG is set.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from typing import Any

from common import machine, reset_table, setup_django, worker_command, worker_env
from scale_common import (
    client_backends,
    commit_hash,
    rss_mib,
    snapshot,
    start_cluster,
    stop_cluster,
    stop_processes,
    use_state,
)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def wait_steady(url: str, procs: list[subprocess.Popen[bytes]], timeout: float) -> int:
    """Wait until every process has a connection and the count holds for 3 s."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        dead = [p.pid for p in procs if p.poll() is not None]
        if dead:
            raise SystemExit(f"workers exited: {dead}")
        now = client_backends(url)
        if now != last:
            last, since = now, time.monotonic()
        elif now >= len(procs) and time.monotonic() - since >= 3:
            return now
        time.sleep(0.5)
    raise SystemExit(f"connections not steady after {timeout} s ({last} open)")


def window(url: str, seconds: float) -> dict[str, Any]:
    before = snapshot(url)
    time.sleep(seconds)
    return snapshot(url).delta(before)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=50)
    parser.add_argument("--window", type=float, default=30.0, help="seconds counted")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds after start-up")
    parser.add_argument(
        "--handlers",
        default="",
        help="comma-separated handler names for run_workers (default: every registered one)",
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupted)
    use_state("idle")
    names = [n for n in args.handlers.split(",") if n]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        url = start_cluster()
        setup_django(url)
        from django.conf import settings
        from django.db import connection

        poll = float(settings.DBWORKER["POLL_INTERVAL"])
        reset_table()
        connection.close()
        print(
            json.dumps(
                {
                    "bench": "scale_idle_run",
                    "commit": commit_hash(),
                    "argv": sys.argv,
                    "machine": machine(),
                }
            ),
            flush=True,
        )
        time.sleep(2)
        baseline = window(url, args.window)
        started = time.perf_counter()
        procs = [
            subprocess.Popen(worker_command(*names), env=worker_env()) for _ in range(args.workers)
        ]
        connections = wait_steady(url, procs, timeout=60 + 3 * args.workers)
        up = time.perf_counter() - started
        time.sleep(args.settle)
        idle = window(url, args.window)
        connections_after = client_backends(url)
        rss = [r for r in (rss_mib(p.pid) for p in procs) if r is not None]
        n, secs = args.workers, idle["seconds"]
        intervals = secs / poll

        def net(key: str) -> float:
            # The baseline's rate, scaled to this window, taken off.
            return idle[key] - baseline[key] * secs / baseline["seconds"]

        statements, commits = net("statements"), net("xact_commit")
        queries = statements - net("statements_control")
        per = n * intervals
        result = {
            "workers": n,
            "handlers": names or "all",
            "poll_interval": poll,
            "window_seconds": secs,
            "start_up_seconds": up,
            "connections": connections,
            "connections_after_window": connections_after,
            "connections_per_process": connections_after / n,
            "statements_per_second": statements / secs,
            "queries_per_second": queries / secs,
            "commits_per_second": commits / secs,
            "rollbacks_per_second": net("xact_rollback") / secs,
            "server_cpu_share": net("server_cpu_seconds") / secs,
            "statements_per_process_per_poll": statements / per,
            "queries_per_process_per_poll": queries / per,
            "commits_per_process_per_poll": commits / per,
            "rows_returned_per_process_per_poll": net("tup_returned") / per,
            "rows_updated_per_process_per_poll": net("tup_updated") / per,
            "baseline_statements_per_second": baseline["statements"] / baseline["seconds"],
            "baseline_commits_per_second": baseline["xact_commit"] / baseline["seconds"],
            "rss_mib_total": sum(rss),
            "rss_mib_mean": sum(rss) / len(rss) if rss else 0.0,
            "rss_mib_max": max(rss) if rss else 0.0,
            "top_statements_per_process_per_poll": [
                (q[:200], round(c / per, 4)) for q, c in idle["top"]
            ],
        }
        print(json.dumps({"bench": "scale_idle", **result}), flush=True)
        for key, value in result.items():
            if key.startswith("top_"):
                continue
            shown = f"{value:,.3f}" if isinstance(value, float) else str(value)
            print(f"  {key}  {shown}", file=sys.stderr)
        for query, count in [(q, c / per) for q, c in idle["top"]]:
            print(f"  {count:8.4f}  {' '.join(str(query).split())[:110]}", file=sys.stderr)
        codes = stop_processes(procs)
        procs = []
        if any(codes):
            raise SystemExit(f"workers exited with {codes}")
    finally:
        stop_processes(procs)
        stop_cluster()


if __name__ == "__main__":
    main()
