"""W12: fair share between tenants, against today's claim order, on one cluster in one run.

    .venv/bin/python bench/w12_fair.py [--flood 100000] [--job-ms 10] [--seconds 30]

Three measures, each with ``--processes`` ``run_workers`` processes of ``--concurrency``
threads:

1. **Latency behind a flood.** Tenant A has ``--flood`` ready items of ``--job-ms`` ms;
   tenant B enqueues one item every 100 ms for ``--seconds`` s. B's start latency (its
   handler's start, by the handler's clock, less its row's ``created_at``) p50 / p99,
   once with fair keys (A and B) and once without (today's order), the same items.
   Without keys B's items wait for A's backlog: those not started when the leg ends
   count with the time they had waited (a lower bound, said in ``*_unstarted``).
2. **Weights.** Tenants C (weight 3) and D (weight 1) flood together for ``--seconds``
   s: the ratio of their starts (rows' ``claimed_at``) in each 10 s window (target 3).
3. **Throughput.** ``--items`` no-op items (``--item-ms``: items of that many ms)
   over ``--keys`` fair keys drained with ``--burst``, against the same items without
   keys (W1): the fair claim's share (target >= 0.9), by *active* rate (first claim to
   last finish), and the CPU per item of the worker processes and of the database.

``--only throughput`` runs the third alone (``--only`` is repeatable).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import time
from typing import Any

from common import (
    children_cpu_seconds,
    database_cpu_seconds,
    report,
    reset_table,
    settle_table,
    setup_django,
    start_postgres,
    stop_postgres,
    wait_for_backends_to_exit,
    worker_command,
    worker_env,
)

HANDLERS = ("bench_noop", "bench_latency")


def start_workers(processes: int, concurrency: int, *extra: str) -> list[subprocess.Popen[Any]]:
    return [
        subprocess.Popen(
            worker_command(*HANDLERS, "--concurrency", str(concurrency), *extra), env=worker_env()
        )
        for _ in range(processes)
    ]


def stop(workers: list[subprocess.Popen[Any]]) -> None:
    for proc in workers:
        proc.send_signal(signal.SIGTERM)
    for proc in workers:
        proc.wait(120)


def flood(key: str | None, count: int, job_ms: float) -> None:
    from bench.benchapp.workers import BenchNoop

    job = {"ms": job_ms} if job_ms else None
    for start in range(0, count, 5000):
        BenchNoop.enqueue_many([job] * min(5000, count - start), fair_key=key)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latency_leg(args: argparse.Namespace, fair: bool) -> dict[str, Any]:
    """Tenant B's start latencies (ms) behind tenant A's flood, fair keys or none."""
    from bench.benchapp.workers import BenchLatency
    from django_dbworker.models import WorkItem

    reset_table()
    flood("A" if fair else None, args.flood, args.job_ms)
    settle_table()
    workers = start_workers(args.processes, args.concurrency)
    ids = []
    began = time.monotonic()
    tick = began
    while time.monotonic() - began < args.seconds:
        ids.append(BenchLatency.enqueue(None, fair_key="B" if fair else None).pk)
        tick += 0.1
        time.sleep(max(0.0, tick - time.monotonic()))
    deadline = time.monotonic() + 5
    rows = WorkItem.objects.filter(pk__in=ids)
    while rows.exclude(status="succeeded").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    stop(workers)
    ended = time.time()
    latencies, unstarted = [], 0
    for created_at, result in rows.values_list("created_at", "result"):
        if result is None:
            unstarted += 1
            latencies.append((ended - created_at.timestamp()) * 1000)
        else:
            latencies.append((float(result) - created_at.timestamp()) * 1000)
    leg = "fair" if fair else "plain"
    return {
        f"{leg}_b_items": len(ids),
        f"{leg}_b_p50_ms": percentile(latencies, 0.5),
        f"{leg}_b_p99_ms": percentile(latencies, 0.99),
        f"{leg}_b_unstarted": unstarted,
    }


def weights_leg(args: argparse.Namespace) -> dict[str, Any]:
    """Starts of C (weight 3) over D (weight 1) in each 10 s window of a joint flood."""
    from django_dbworker import set_fair_weight
    from django_dbworker.flow.models import FairKey
    from django_dbworker.models import WorkItem

    reset_table()
    FairKey.objects.all().delete()
    set_fair_weight("C", 3)
    set_fair_weight("D", 1)
    flood("C", args.flood // 2, args.job_ms)
    flood("D", args.flood // 2, args.job_ms)
    settle_table()
    workers = start_workers(args.processes, args.concurrency)
    claimed = WorkItem.objects.filter(claimed_at__isnull=False)
    deadline = time.monotonic() + 60  # the workers' start-up is not part of the leg
    while not claimed.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(args.seconds)
    stop(workers)
    rows = claimed.values_list("fair_key", "claimed_at")
    starts = sorted((at.timestamp(), key) for key, at in rows)
    first = starts[0][0] if starts else 0.0
    windows: dict[int, dict[str, int]] = {}
    for at, key in starts:
        window = windows.setdefault(int((at - first) // 10), {"C": 0, "D": 0})
        window[key] += 1
    # Whole windows only (the last one is cut short by the stop).
    ratios = [w["C"] / w["D"] for n, w in sorted(windows.items())[:-1] if w["D"]]
    return {
        "weights_windows": len(ratios),
        "weights_ratio_min": min(ratios) if ratios else 0.0,
        "weights_ratio_max": max(ratios) if ratios else 0.0,
        "weights_ratio_median": statistics.median(ratios) if ratios else 0.0,
    }


def throughput_leg(args: argparse.Namespace, fair: bool) -> tuple[float, float, float | None]:
    """Active rate (items/s) of a ``--burst`` drain of ``--items`` items, and the CPU per
    item (µs) of the worker processes and of the database server (None: not measurable)."""
    from django.db.models import Max, Min

    from bench.benchapp.workers import BenchNoop
    from django_dbworker.flow.models import FairKey
    from django_dbworker.models import WorkItem

    reset_table()
    FairKey.objects.all().delete()
    per_key = args.items // args.keys
    payload = {"ms": args.item_ms} if args.item_ms else None
    for n in range(args.keys):
        BenchNoop.enqueue_many([payload] * per_key, fair_key=f"t{n}" if fair else None)
    settle_table()
    workers_before, database_before = children_cpu_seconds(), database_cpu_seconds()
    for proc in start_workers(args.processes, args.concurrency, "--burst"):
        proc.wait()
    wait_for_backends_to_exit()
    workers_cpu = children_cpu_seconds() - workers_before
    database_after = database_cpu_seconds()
    found = WorkItem.objects.aggregate(first=Min("claimed_at"), last=Max("finished_at"))
    done = WorkItem.objects.filter(status="succeeded").count()
    database_cpu = (
        None
        if database_before is None or database_after is None
        else (database_after - database_before) / done * 1e6
    )
    rate = done / (found["last"] - found["first"]).total_seconds()
    return rate, workers_cpu / done * 1e6, database_cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--flood", type=int, default=100_000)
    parser.add_argument("--job-ms", type=float, default=10.0, help="each flood item's length")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--item-ms", type=float, default=0.0, help="throughput items' length")
    parser.add_argument(
        "--only", action="append", choices=["latency", "weights", "throughput"], default=[]
    )
    parser.add_argument("--keys", type=int, default=10)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    url = start_postgres()
    try:
        setup_django(url)
        result: dict[str, Any] = {
            "flood": args.flood,
            "job_ms": args.job_ms,
            "seconds": args.seconds,
            "processes": args.processes,
            "concurrency": args.concurrency,
        }
        legs = set(args.only or ["latency", "weights", "throughput"])
        if "latency" in legs:
            result.update(latency_leg(args, fair=True))
            result.update(latency_leg(args, fair=False))
        if "weights" in legs:
            result.update(weights_leg(args))
        if "throughput" not in legs:
            report("w12_fair", result)
            return
        fair_rate, fair_worker_cpu, fair_db_cpu = throughput_leg(args, fair=True)
        plain_rate, plain_worker_cpu, plain_db_cpu = throughput_leg(args, fair=False)
        result.update(
            {
                "items": args.items,
                "keys": args.keys,
                "item_ms": args.item_ms,
                "fair_items_per_second_active": fair_rate,
                "plain_items_per_second_active": plain_rate,
                "fair_share_active": fair_rate / plain_rate,
                # CPU per item, µs: the worker processes' (start-up included) and the
                # database server's.
                "fair_worker_cpu_us": fair_worker_cpu,
                "plain_worker_cpu_us": plain_worker_cpu,
                "fair_database_cpu_us": fair_db_cpu,
                "plain_database_cpu_us": plain_db_cpu,
            }
        )
        report("w12_fair", result)
    finally:
        stop_postgres()


if __name__ == "__main__":
    main()
