"""W4: W1 again with 1,000,000 finished rows in the table.

    .venv/bin/python bench/w4_big_table.py [--finished 1000000] [--items 10000]

Claims must stay index-driven: the finished rows are never read. Runs W1
on the empty table and on the big one in the same process, and reports the
ratio.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from common import ROOT, report, reset_table, setup_django, start_postgres, stop_postgres

BENCH = Path(__file__).resolve().parent


def w1(items: int, concurrency: int, keep_rows: bool) -> float:
    cmd = [
        sys.executable,
        str(BENCH / "w1_throughput.py"),
        "--items",
        str(items),
        "--concurrency",
        str(concurrency),
    ]
    if keep_rows:
        cmd.append("--keep-rows")
    import json
    import os

    env = dict(os.environ, BENCH_KEEP_PG="1")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
    return float(json.loads(out.stdout.splitlines()[0])["items_per_second_active"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--finished", type=int, default=1_000_000)
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    url = start_postgres()
    try:
        setup_django(url)
        reset_table()
        empty = w1(args.items, args.concurrency, keep_rows=False)
        reset_table()
        sys.path.insert(0, str(ROOT))
        from django.db import connection

        from bench.bigtable import fill

        fill(args.finished)
        with connection.cursor() as cursor:
            # Only finished rows: the W1 run adds its own pending ones.
            cursor.execute(
                "DELETE FROM django_dbworker_workitem WHERE status IN ('pending', 'claimed')"
            )
            cursor.execute("VACUUM ANALYZE django_dbworker_workitem")
        big = w1(args.items, args.concurrency, keep_rows=True)
        report(
            "w4_big_table",
            {
                "finished_rows": args.finished,
                "items": args.items,
                "empty_items_per_second": empty,
                "big_items_per_second": big,
                "ratio": big / empty,
            },
        )
    finally:
        stop_postgres()


if __name__ == "__main__":
    main()
