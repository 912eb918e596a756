"""The claim's time when the table's statistics say it is empty but it holds a backlog.

    .venv/bin/python bench/claim_stale_stats.py [--backlog 20000] [--claims 30]

Builds the state of W6's slow mode (``w6_priority.stale_statistics``: an
ANALYZE that counted the pages but none of the rows of an uncommitted
backlog), then times claims of 1, 8 and 64 rows two ways, alternated: as
the operations run them (with ``CLAIM_PLAN``'s settings) and the bare
statement bound on the server, as before. Medians and maxima in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from common import report, reset_table, setup_django, start_postgres, stop_postgres
from w6_priority import stale_statistics


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backlog", type=int, default=20_000)
    parser.add_argument("--claims", type=int, default=30)
    args = parser.parse_args()
    url = start_postgres()
    try:
        setup_django(url)
        from bench.benchapp.workers import BenchSleep
        from django_dbworker.db import operations
        from django_dbworker.db.postgresql_sql import claim_statement

        reset_table()
        backlog = [{"seconds": 0.0}] * args.backlog
        stale_statistics(lambda: BenchSleep.enqueue_many(backlog, priority=0))
        ops = operations()
        result: dict[str, float] = {}
        how: dict[str, Any] = {"handlers": ["bench_sleep"], "queues": None, "worker": "w"}
        for limit in (1, 8, 64):
            times: dict[str, list[float]] = {"planned": [], "bare": []}
            for _ in range(2):
                for mode in times:
                    for _ in range(args.claims):
                        started = time.perf_counter()
                        if mode == "planned":
                            ops.claim(limit=limit, **how)
                        else:
                            sql, params = claim_statement(limit=limit, **how)
                            ops._fetch_bound(sql, params)  # type: ignore[attr-defined]
                        times[mode].append((time.perf_counter() - started) * 1000.0)
            for mode, values in times.items():
                result[f"limit_{limit}_{mode}_p50_ms"] = statistics.median(values)
                result[f"limit_{limit}_{mode}_max_ms"] = max(values)
        report("claim_stale_stats", result)
    finally:
        stop_postgres()


if __name__ == "__main__":
    main()
