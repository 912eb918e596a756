"""W2: enqueue speed: single enqueue() calls, each its own transaction; enqueue_many.

.venv/bin/python bench/w2_enqueue.py [--single 5000] [--many 10000]

With the single enqueues' CPU: ``single_client_cpu_us`` (this process's,
``enqueue()`` to its commit) and ``single_database_cpu_us`` (the server's,
``/proc``), each per enqueue.
"""

from __future__ import annotations

import argparse
import time

from common import (
    database_cpu_seconds,
    report,
    reset_table,
    setup_django,
    start_postgres,
    stop_postgres,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--single", type=int, default=5_000)
    parser.add_argument("--many", type=int, default=10_000)
    args = parser.parse_args()
    url = start_postgres()
    try:
        setup_django(url)
        from bench.benchapp.workers import BenchNoop

        reset_table()
        BenchNoop.enqueue(None)  # warm up the connection and caches
        reset_table()
        database_before = database_cpu_seconds()
        client_before = time.process_time()
        started = time.perf_counter()
        for n in range(args.single):
            BenchNoop.enqueue({"n": n})
        single = args.single / (time.perf_counter() - started)
        client_cpu = time.process_time() - client_before
        database_after = database_cpu_seconds()
        reset_table()
        payloads = [{"n": n} for n in range(args.many)]
        started = time.perf_counter()
        BenchNoop.enqueue_many(payloads)
        many = args.many / (time.perf_counter() - started)
        report(
            "w2_enqueue",
            {
                "single": args.single,
                "single_per_second": single,
                "single_client_cpu_us": client_cpu * 1e6 / args.single,
                "single_database_cpu_us": (
                    None
                    if database_before is None or database_after is None
                    else (database_after - database_before) * 1e6 / args.single
                ),
                "many": args.many,
                "many_per_second": many,
            },
        )
    finally:
        stop_postgres()


if __name__ == "__main__":
    main()
