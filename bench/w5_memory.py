"""W5: memory of one worker over many items: RSS at start and at the end.

    .venv/bin/python bench/w5_memory.py [--items 100000]

Enqueues ``--items`` no-op items, runs one ``run_workers --burst`` and samples
its resident set size (/proc/PID/status VmRSS) every 100 ms. "Start" is the
RSS once the first 5% of the items are done (imports, connections and caches
are warm by then); "end" is the last sample before exit.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

from common import (
    report,
    reset_table,
    setup_django,
    start_postgres,
    stop_postgres,
    worker_command,
    worker_env,
)


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=100_000)
    args = parser.parse_args()
    url = start_postgres()
    try:
        setup_django(url)
        from bench.benchapp.workers import BenchNoop
        from django_dbworker.models import WorkItem

        reset_table()
        for start in range(0, args.items, 5000):
            BenchNoop.enqueue_many([None] * min(5000, args.items - start))
        proc = subprocess.Popen(worker_command("bench_noop", "--burst"), env=worker_env())
        start_rss = None
        last_rss = None
        warm = max(1, args.items // 20)
        while proc.poll() is None:
            sample = rss_kib(proc.pid)
            if sample is not None:
                last_rss = sample
                if start_rss is None and (
                    WorkItem.objects.filter(status="succeeded").count() >= warm
                ):
                    start_rss = sample
            time.sleep(0.1)
        assert proc.returncode == 0, proc.returncode
        done = WorkItem.objects.filter(status="succeeded").count()
        if start_rss is None or last_rss is None:
            raise SystemExit("the worker finished before it could be sampled")
        report(
            "w5_memory",
            {
                "items": args.items,
                "succeeded": done,
                "rss_start_mib": start_rss / 1024,
                "rss_end_mib": last_rss / 1024,
                "growth": (last_rss - start_rss) / start_rss,
            },
        )
    finally:
        stop_postgres()


if __name__ == "__main__":
    main()
