"""django-tasks-db (its db_worker) through W1/W2/W3 (run with its own venv's python)."""

from __future__ import annotations

import sys
import time

import djtasks_app
from django.core.management import call_command
from peer_common import emit, latency_run


def main() -> None:
    mode = sys.argv[1]
    if mode == "worker":
        call_command("db_worker", "--no-startup-delay", "--no-reload")
        return
    call_command("migrate", verbosity=0)
    if mode == "w1":
        items = int(sys.argv[2])
        for _ in range(items):
            djtasks_app.noop.enqueue()
        started = time.perf_counter()
        call_command("db_worker", "--batch", "--no-startup-delay", "--no-reload", verbosity=0)
        emit(
            bench="w1_throughput",
            items=items,
            items_per_second=items / (time.perf_counter() - started),
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
