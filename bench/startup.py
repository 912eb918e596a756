"""Start-up: ``run_workers`` from process start to its first finished job, and a burst of one.

    .venv/bin/python bench/startup.py [--runs 5]

Two figures per run, on one enqueued no-op item: *first job*, from
spawning ``run_workers`` (long-running mode) to the item's ``finished_at``
(the same host's clock, through the database); and *burst*, the wall time
of ``run_workers --burst`` for one item, start to exit (what cron-driven
and autoscaled workers pay per start).
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    url = start_postgres()
    try:
        setup_django(url)
        from bench.benchapp.workers import BenchNoop
        from django_dbworker.models import WorkItem

        first_job: list[float] = []
        burst: list[float] = []
        for _ in range(args.runs):
            reset_table()
            item = BenchNoop.enqueue(None)
            spawned = time.time()
            proc = subprocess.Popen(worker_command("bench_noop"), env=worker_env())
            deadline = time.monotonic() + 60
            while True:
                finished = WorkItem.objects.filter(pk=item.pk).values_list(
                    "finished_at", flat=True
                )[0]
                if finished is not None:
                    break
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("the worker did not finish its first job")
                time.sleep(0.005)
            first_job.append(finished.timestamp() - spawned)
            proc.terminate()
            proc.wait(30)

            reset_table()
            BenchNoop.enqueue(None)
            started = time.perf_counter()
            subprocess.run(worker_command("bench_noop", "--burst"), env=worker_env(), check=True)
            burst.append(time.perf_counter() - started)
        report(
            "startup",
            {
                "runs": args.runs,
                "first_job_s_median": statistics.median(first_job),
                "first_job_s_min": min(first_job),
                "burst_one_s_median": statistics.median(burst),
                "burst_one_s_min": min(burst),
            },
        )
    finally:
        stop_postgres()


if __name__ == "__main__":
    main()
