"""What one claim statement costs, outside a worker: the plain claim, the keyed one, the split.

    .venv/bin/python bench/claim_cost.py [--rounds 8] [--claim 500] [--keys 100]

Times ``operations().claim(limit=--claim)`` on the benchmark cluster, with
no worker running, the claimed rows put back to pending after each round:

- *unkeyed*: 10 x ``--claim`` pending no-op rows, claimed by the plain
  claim; by the keyed claim (every claim of a worker that also serves a
  limited handler is keyed); and by a split claim cycle (the limited
  handler's keyed claim, which finds nothing, then the plain claim: tried
  in 827da04 and reverted, as it broke the claim order across the two).
- *W7's table*: 100 x ``--keys`` rows of ``--keys`` keys with limit 1 (no
  key held), the keyed claim taking one row of each key.
- *A hot key*: ``--hot`` pending rows of one key at its limit (one of them
  claimed), ahead of 10 rows of each of ``--keys`` other keys; the keyed claim
  of a worker of the limited handler only (PostgreSQL: the key-driven claim,
  ``CLAIM_HEADS``) and of one that also serves an unlimited handler (the
  walk, which reads the hot key's backlog).

Medians and minima in milliseconds (the claim and building its items).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from common import (
    report,
    reset_table,
    settle_table,
    setup_django,
    start_postgres,
    stop_postgres,
)


def timed(claim: Callable[[], list], rounds: int, expect: int) -> list[float]:
    from django_dbworker.models import WorkItem

    took = []
    for _ in range(rounds):
        started = time.perf_counter()
        items = claim()
        took.append((time.perf_counter() - started) * 1000.0)
        if len(items) != expect:
            raise SystemExit(f"claimed {len(items)} rows, expected {expect}")
        WorkItem.objects.filter(id__in=[i.pk for i in items]).update(status="pending")
    return took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--claim", type=int, default=500)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--hot", type=int, default=20_000)
    args = parser.parse_args()
    size = args.claim
    url = start_postgres()
    try:
        setup_django(url)
        from django.db import transaction

        from bench.benchapp.workers import BenchKeyed, BenchNoop
        from django_dbworker.db import operations

        ops = operations("default")
        keyed = {"bench_keyed": 1}
        common: dict = {"queues": None, "worker": "bench", "limits": keyed}

        def plain() -> list:
            return ops.claim(limit=size, handlers=["bench_noop"], queues=None, worker="bench")

        def keyed_path() -> list:
            names = ["bench_noop", "bench_keyed"]
            return ops.claim(limit=size, handlers=names, queues=None, worker="bench", limits=keyed)

        def limited() -> list:
            names = ["bench_keyed"]
            return ops.claim(limit=size, handlers=names, queues=None, worker="bench", limits=keyed)

        def split() -> list:
            limited()
            return plain()

        reset_table()
        BenchNoop.enqueue_many([None] * (10 * size))
        results: dict[str, float] = {}
        for name, claim in (("plain", plain), ("keyed", keyed_path), ("split", split)):
            took = timed(claim, args.rounds, size)
            results[f"unkeyed_{name}_ms"] = statistics.median(took)
            results[f"unkeyed_{name}_min_ms"] = min(took)
        reset_table()
        with transaction.atomic():
            for n in range(100 * args.keys):
                BenchKeyed.enqueue(None, concurrency_key=f"k{n % args.keys}")
        took = timed(limited, args.rounds, min(size, args.keys))
        results["w7_keyed_ms"] = statistics.median(took)
        results["w7_keyed_min_ms"] = min(took)

        reset_table()
        BenchKeyed.enqueue_many([None] * args.hot, concurrency_key="hot")
        with transaction.atomic():
            for n in range(10 * args.keys):
                BenchKeyed.enqueue(None, concurrency_key=f"k{n % args.keys}")
        settle_table()
        assert len(ops.claim(limit=1, handlers=["bench_keyed"], **common)) == 1  # hot is held

        def walked() -> list:
            names = ["bench_keyed", "bench_noop"]
            return ops.claim(limit=size, handlers=names, queues=None, worker="bench", limits=keyed)

        for name, claim in (("heads", limited), ("walk", walked)):
            took = timed(claim, args.rounds, min(size, args.keys))
            results[f"hot_{name}_ms"] = statistics.median(took)
            results[f"hot_{name}_min_ms"] = min(took)
        report(
            "claim_cost",
            {"rounds": args.rounds, "claim": size, "keys": args.keys, "hot": args.hot, **results},
        )
    finally:
        stop_postgres()


if __name__ == "__main__":
    main()
