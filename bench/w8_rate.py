"""W8: a rate limit held across worker processes, from the handlers' own start times.

    .venv/bin/python bench/w8_rate.py [--rate 200] [--seconds 10] [--processes 2]

Enqueues ``rate * (seconds + 1)`` items of a handler whose ``rate_limit`` is
``"<rate>/s"`` (so the workers are never short of work), starts
``--processes`` ``run_workers`` at their default settings, and waits until
every item ran. The handler returns the time it started. Reported:

- ``start_rate_per_s``: the long-run start rate, ``(n - rate)`` starts
  after the first window's ``rate``, over the time from the ``rate``-th
  start to the last (the first window is a burst: the workers claim as fast
  as they can until the window is full);
- ``max_in_1s``: the most starts in any one-second window (the limit: at
  most ``rate``);
- ``rate_error_pct``: how far the long-run rate is from ``rate``;
- ``claim_to_start_ms_p50`` / ``_max``: from the row's claim (the
  database's clock; the same host) to its handler's start: rate-limited
  rows are claimed (and buffered) like any others, and each takes its start
  in the window just before it runs;
- ``per_process``: how the starts split between the processes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

from common import report, reset_table, setup_django, start_postgres, stop_postgres, worker_env


def most_in_window(times: list[float], seconds: float) -> int:
    """The most values of sorted ``times`` in any half-open window of ``seconds``."""
    most = start = 0
    for end, t in enumerate(times):
        while t - times[start] >= seconds:
            start += 1
        most = max(most, end - start + 1)
    return most


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=int, default=200)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    os.environ["BENCH_RATE_LIMIT"] = f"{args.rate}/s"
    url = start_postgres()
    try:
        setup_django(url)
        from bench.benchapp.workers import BenchRated
        from django_dbworker.flow.models import RateStart
        from django_dbworker.models import WorkItem

        reset_table()
        RateStart.objects.all().delete()
        n = args.rate * (args.seconds + 1)
        BenchRated.enqueue_many([None] * n)
        from common import worker_command

        procs = [
            subprocess.Popen(worker_command("bench_rated"), env=worker_env())
            for _ in range(args.processes)
        ]
        done = WorkItem.objects.filter(handler="bench_rated", status="succeeded")
        deadline = time.monotonic() + args.seconds * 3 + 60
        while done.count() < n:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit("the workers did not run every item in time")
            time.sleep(0.1)
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
        rows = list(done.values_list("result", "claimed_by", "claimed_at"))
        starts = sorted(float(t) for t, _, _ in rows)
        delays = sorted(
            (float(t) - claimed_at.timestamp()) * 1000.0 for t, _, claimed_at in rows if claimed_at
        )
        steady = (n - args.rate) / (starts[-1] - starts[args.rate - 1])
        by_process: dict[str, int] = {}
        for _, claimed_by, _ in rows:
            pid = str(claimed_by).split(":")[1] if claimed_by else "?"
            by_process[pid] = by_process.get(pid, 0) + 1
        report(
            "w8_rate",
            {
                "rate_limit": f"{args.rate}/s",
                "processes": args.processes,
                "items": n,
                "start_rate_per_s": steady,
                "rate_error_pct": 100.0 * (steady - args.rate) / args.rate,
                "naive_rate_per_s": n / (starts[-1] - starts[0]),
                "max_in_1s": most_in_window(starts, 1.0),
                "max_in_1s_over_limit": max(0, most_in_window(starts, 1.0) - args.rate),
                "span_s": starts[-1] - starts[0],
                "claim_to_start_ms_p50": delays[len(delays) // 2],
                "claim_to_start_ms_max": delays[-1],
                "per_process": ",".join(str(c) for _, c in sorted(by_process.items())),
            },
        )
    finally:
        stop_postgres()


if __name__ == "__main__":
    main()
