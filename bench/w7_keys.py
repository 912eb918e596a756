"""W7: throughput with per-key concurrency limits, against the same items without keys.

    .venv/bin/python bench/w7_keys.py [--job-ms 5] [--items 10000] [--keys 100] [--processes 2]

Enqueues ``--items`` items spread round-robin over ``--keys`` concurrency keys
of a handler with ``concurrency_limit = 1`` (not timed), each a job of
``--job-ms`` milliseconds (a sleep; 0: no work), drains them with
``--processes`` ``run_workers --burst`` processes, then does the same with the
same items without a key: the keyed claim against the one-statement claim, on
one cluster, minutes apart. Rates as W1's (*whole*: spawn to exit; *active*:
the first ``claimed_at`` to the last ``finished_at``); ``keyed_share_active``
is the keyed active rate as a share of the plain one (the target: >= 0.9 at
5 ms jobs). At 0 ms it measures the chain itself: a key moves one item per
claim, run and success write. The script also checks that no two items of one
key were claimed at once: each key's items ran one after another (claimed
after the previous one finished, by the rows' own timestamps).

``*_cpu_busy`` is the share of the machine's cores busy over a leg (workers,
server and all, from ``/proc/stat``), ``*_cpu_us_per_item`` the busy CPU per
item: a leg that leaves cores idle at the same CPU per item is waiting on a
chain, not short of CPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from typing import Any

from common import (
    commits,
    machine_cpu,
    report,
    reset_table,
    settle_table,
    setup_django,
    start_postgres,
    stop_postgres,
    worker_command,
    worker_env,
)


def drain(handler: str, processes: int, concurrency: int) -> tuple[float, list[int], dict]:
    """Run ``processes`` burst workers of ``handler`` to the end; seconds taken, exit codes,
    and the machine's CPU over the leg (``cpu_busy``: the share of all cores busy;
    ``cpu_s``: busy CPU seconds, workers and server alike; none off Linux)."""
    cpu = machine_cpu()
    spawned = time.perf_counter()
    procs = [
        subprocess.Popen(
            worker_command(handler, "--burst", "--concurrency", str(concurrency)),
            env=worker_env(),
        )
        for _ in range(processes)
    ]
    codes = [p.wait() for p in procs]
    whole = time.perf_counter() - spawned
    after = machine_cpu()
    used: dict[str, float] = {}
    if cpu is not None and after is not None and after[1] > cpu[1]:
        busy, total = after[0] - cpu[0], after[1] - cpu[1]
        used = {"cpu_busy": busy / total, "cpu_s": busy / os.sysconf("SC_CLK_TCK")}
    return whole, codes, used


def cpu_figures(leg: str, used: dict, items: int) -> dict[str, float]:
    """The leg's share of the machine's cores kept busy, and busy CPU microseconds an item
    (whole process: start-up included, the server's share too)."""
    if not used:
        return {}
    per_item = used["cpu_s"] / items * 1e6
    return {f"{leg}_cpu_busy": used["cpu_busy"], f"{leg}_cpu_us_per_item": per_item}


def span(handler: str) -> float:
    from django.db.models import Max, Min

    from django_dbworker.models import WorkItem

    found = WorkItem.objects.filter(handler=handler).aggregate(
        first=Min("claimed_at"), last=Max("finished_at")
    )
    return float((found["last"] - found["first"]).total_seconds())


def key_overlaps(handler: str) -> int:
    """Items claimed before the previous item of their key finished (must be 0)."""
    from django_dbworker.models import WorkItem

    rows = WorkItem.objects.filter(handler=handler).order_by("concurrency_key", "claimed_at")
    overlaps = 0
    last: dict[str, Any] = {}
    for key, claimed_at, finished_at in rows.values_list(
        "concurrency_key", "claimed_at", "finished_at"
    ):
        previous = last.get(key)
        if previous is not None and claimed_at < previous:
            overlaps += 1
        last[key] = finished_at
    return overlaps


def links(handler: str) -> dict[str, float | None]:
    """Where a key's chain of items spends its time (medians over every link, ms).

    *held*: an item's claim to its success write (the claim's commit, the
    wait in the buffer and for a thread, the run, the hand-over to the
    writer); *free*: that write to the next item's claim (the write's
    commit, and the wait for a claim that sees the slot free). A key moves
    one item per held + free; the plain W1 stream has no such chain.
    """
    import statistics

    from django_dbworker.models import WorkItem

    rows = WorkItem.objects.filter(handler=handler).order_by("concurrency_key", "claimed_at")
    held: list[float] = []
    free: list[float] = []
    last: dict[str, Any] = {}
    for key, claimed_at, finished_at in rows.values_list(
        "concurrency_key", "claimed_at", "finished_at"
    ):
        held.append((finished_at - claimed_at).total_seconds() * 1000.0)
        previous = last.get(key)
        if previous is not None:
            free.append((claimed_at - previous).total_seconds() * 1000.0)
        last[key] = finished_at
    # With one item per key there is no chain: no free time to report.
    return {
        "slot_held_p50_ms": statistics.median(held),
        "slot_free_p50_ms": statistics.median(free) if free else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--job-ms", type=float, default=0.0, help="each job's length (a sleep)")
    args = parser.parse_args()
    url = start_postgres()
    try:
        setup_django(url)
        from django.db import transaction

        from bench.benchapp.workers import BenchKeyed, BenchNoop
        from django_dbworker.models import WorkItem

        reset_table()
        # Round-robin claim order: item n is of key n % keys (a batch per key
        # would put each key's items in one run of ids, one key after another).
        job = {"ms": args.job_ms} if args.job_ms else None
        with transaction.atomic():
            for n in range(args.items):
                BenchKeyed.enqueue(job, concurrency_key=f"k{n % args.keys}")
        settle_table()
        before = commits()
        keyed_whole, keyed_codes, keyed_cpu = drain("bench_keyed", args.processes, args.concurrency)
        keyed_commits = commits() - before
        keyed_done = WorkItem.objects.filter(handler="bench_keyed", status="succeeded").count()
        keyed_active = span("bench_keyed")
        overlaps = key_overlaps("bench_keyed")
        chain = links("bench_keyed")

        # The plain leg on a table of its own, as the keyed one: not on the keyed
        # leg's finished rows and dead tuples, which autovacuum would reach mid-leg.
        reset_table()
        for start in range(0, args.items, 5000):
            BenchNoop.enqueue_many([job] * min(5000, args.items - start))
        settle_table()
        before = commits()
        plain_whole, plain_codes, plain_cpu = drain("bench_noop", args.processes, args.concurrency)
        plain_commits = commits() - before
        plain_done = WorkItem.objects.filter(handler="bench_noop", status="succeeded").count()
        plain_active = span("bench_noop")
        report(
            "w7_keys",
            {
                "items": args.items,
                "keys": args.keys,
                "processes": args.processes,
                "concurrency": args.concurrency,
                "job_ms": args.job_ms,
                "keyed_items_per_second_whole": args.items / keyed_whole,
                "keyed_items_per_second_active": args.items / keyed_active,
                "plain_items_per_second_whole": args.items / plain_whole,
                "plain_items_per_second_active": args.items / plain_active,
                "keyed_share_active": plain_active / keyed_active,
                "keyed_share_whole": plain_whole / keyed_whole,
                "keyed_commits_per_item": keyed_commits / args.items,
                "plain_commits_per_item": plain_commits / args.items,
                **cpu_figures("keyed", keyed_cpu, args.items),
                **cpu_figures("plain", plain_cpu, args.items),
                "key_overlaps": overlaps,
                **chain,
                "exit_codes": keyed_codes + plain_codes,
            },
        )
        if keyed_done != args.items or plain_done != args.items:
            raise SystemExit(f"not every item succeeded ({keyed_done}, {plain_done})")
        if overlaps or any(keyed_codes + plain_codes):
            raise SystemExit(f"{overlaps} items of a key claimed before the previous one finished")
    finally:
        stop_postgres()


if __name__ == "__main__":
    main()
