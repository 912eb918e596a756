"""Django ``@task`` functions: DBWorkerBackend against django-tasks-db, W1 and W3.

    .venv/bin/python bench/tasks_compare.py [--runs 3] [--items 10000]
        [--latency-items 200] [--rate 20] [--skip-peer]

On one durable PostgreSQL cluster, each run measures, side by side:

- ``task``: ``@task`` functions of bench/benchapp/tasks.py on
  ``django_dbworker.tasks.DBWorkerBackend`` (bench/settings.py TASKS), run
  by ``run_workers``;
- ``handler``: the same work as plain ``WorkItemHandler`` classes
  (``bench_noop``, ``bench_latency``), the reference for the task layer's
  own cost;
- ``django-tasks-db``: its ``db_worker`` through bench/peer_harness/djtasks_bench.py
  in its own virtual environment (bench/.peers/django-tasks-db, see peers.py);
- ``raw``: bench/raw_ceiling.py, the machine's commit rate and the ceiling.

W1: ``--items`` no-op jobs enqueued one call at a time with the task API
(``noop.enqueue()``; ``BenchNoop.enqueue(None)`` for the handler) in one
transaction, not timed, then one worker drains them: ``run_workers --burst``
at ``--concurrency`` 8 and 1; ``db_worker --batch`` (one task at a time, it
has no concurrency setting) twice: with Django's default settings
(``CONN_MAX_AGE`` 0, so db_worker reconnects after every task), and "tuned"
(``CONN_MAX_AGE`` None, and ``ANALYZE`` of its table after the enqueues, as
autovacuum would do in time: without statistics PostgreSQL sorts every ready
row for each claim). "active" is first claim to last finish from the
rows' own timestamps; "wall" includes our worker's interpreter start-up
(django-tasks-db's worker runs inside its harness process, so it has none).

W3: an idle worker, ``--latency-items`` jobs enqueued one at a time (each its
own transaction) at ``--rate`` per second; latency is from the enqueuing
commit's return to the function's start. Our worker polls every 30 s, so only
LISTEN/NOTIFY wakes it; django-tasks-db polls (``db_worker`` default: 1 s).

The order of the task and handler sides alternates between runs. One JSON
line per result on stdout (also appended to ``--save``, by default
bench/results/tasks_compare.jsonl), then a Markdown table of the medians,
with ratios taken within each run. Results: docs/internals/django-tasks-bench.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import (
    ROOT,
    commits,
    machine,
    report,
    reset_table,
    setup_django,
    start_postgres,
    stop_postgres,
    worker_command,
    worker_env,
)

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
PEER = "django-tasks-db"
#: Our worker's names: the @task functions' import paths, and the handlers'.
WORKERS = {
    "task": ("bench.benchapp.tasks.noop", "bench.benchapp.tasks.latency"),
    "handler": ("bench_noop", "bench_latency"),
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def enqueuers() -> dict[str, tuple[Callable[[], object], Callable[[], int]]]:
    """Per side: enqueue one no-op job, and enqueue one latency job returning its row id."""
    from bench.benchapp import tasks
    from bench.benchapp.workers import BenchLatency, BenchNoop

    return {
        "task": (tasks.noop.enqueue, lambda: int(tasks.latency.enqueue().id)),
        "handler": (lambda: BenchNoop.enqueue(None), lambda: BenchLatency.enqueue(None).pk),
    }


def w1_ours(side: str, enqueue: Callable[[], object], items: int, concurrency: int) -> dict:
    from django.db import transaction
    from django.db.models import Max, Min

    from django_dbworker.models import WorkItem

    reset_table()
    started = time.perf_counter()
    with transaction.atomic():
        for _ in range(items):
            enqueue()
    enqueue_seconds = time.perf_counter() - started
    commits_before = commits()
    started = time.perf_counter()
    proc = subprocess.Popen(
        worker_command(WORKERS[side][0], "--burst", "--concurrency", str(concurrency)),
        env=worker_env(),
    )
    code = proc.wait(timeout=1800)
    wall = time.perf_counter() - started
    time.sleep(0.5)  # the worker's sessions report their commits as they end
    worker_commits = commits() - commits_before
    done = WorkItem.objects.filter(status="succeeded").count()
    span = WorkItem.objects.aggregate(first=Min("claimed_at"), last=Max("finished_at"))
    active = (span["last"] - span["first"]).total_seconds()
    if done != items or code:
        raise SystemExit(f"W1 {side}: {done} of {items} succeeded, exit code {code}")
    return {
        "items": items,
        "concurrency": concurrency,
        "items_per_second_active": items / active,
        "items_per_second_wall": items / wall,
        "commits_per_item": worker_commits / items,
        "enqueue_in_one_transaction_per_second": items / enqueue_seconds,
    }


def w3_ours(side: str, enqueue: Callable[[], int], items: int, rate: float) -> dict:
    from django_dbworker.models import WorkItem

    reset_table()
    proc = subprocess.Popen(worker_command(WORKERS[side][1], "--interval", "30"), env=worker_env())
    try:
        enqueue()  # warm-up: wait until the worker is up and has run one
        deadline = time.monotonic() + 60
        while not WorkItem.objects.filter(status="succeeded").exists():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"W3 {side}: the worker did not start")
            time.sleep(0.05)
        reset_table()
        committed: dict[int, float] = {}
        next_at = time.monotonic()
        for _ in range(items):
            pk = enqueue()  # autocommit: its own transaction
            committed[pk] = time.time()
            next_at += 1.0 / rate
            time.sleep(max(0.0, next_at - time.monotonic()))
        deadline = time.monotonic() + 60
        while WorkItem.objects.filter(status="succeeded").count() < items:
            if time.monotonic() > deadline:
                raise SystemExit(f"W3 {side}: items did not finish")
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(30)
    latencies = [
        (float(started) - committed[pk]) * 1000.0
        for pk, started in WorkItem.objects.values_list("pk", "result")
    ]
    return {
        "items": items,
        "rate_per_second": rate,
        "p50_ms": statistics.median(latencies),
        "p99_ms": percentile(latencies, 0.99),
        "max_ms": max(latencies),
    }


def raw_ceiling(items: int) -> dict:
    inserts = str(min(items, 5_000))
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH / "raw_ceiling.py"),
            "--items",
            str(items),
            "--inserts",
            inserts,
        ],
        env=dict(os.environ, BENCH_KEEP_PG="1"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if out.returncode != 0:
        raise SystemExit(f"raw_ceiling.py failed:\n{out.stderr[-3000:]}")
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    return {k: v for k, v in result.items() if k not in ("bench", "machine")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--latency-items", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, action="append")
    parser.add_argument("--skip-peer", action="store_true", help="ours and raw only")
    parser.add_argument(
        "--save",
        default=str(RESULTS / "tasks_compare.jsonl"),
        help="append the JSON lines to this file too ('' for none)",
    )
    args = parser.parse_args()
    concurrencies = args.concurrency or [8, 1]
    save = Path(args.save) if args.save else None
    if save is not None:
        save.parent.mkdir(parents=True, exist_ok=True)
    url = start_postgres()
    os.environ["DATABASE_URL"] = url
    os.environ["BENCH_TASKS"] = "1"  # bench/settings.py: the Tasks framework, here and in workers
    rows: list[dict[str, Any]] = []

    def record(run: int, workload: str, side: str, result: dict[str, Any]) -> None:
        row = {"run": run, "workload": workload, "side": side, **result}
        rows.append(row)
        report("tasks_compare", row)
        if save is not None:
            with open(save, "a") as fh:
                fh.write(json.dumps({"bench": "tasks_compare", **row, "machine": machine()}) + "\n")
        sys.stdout.flush()

    started = time.time()
    try:
        setup_django(url)
        if not args.skip_peer:
            from peers import PEERS, fresh_database, venv_python
            from peers import run as run_peer

            packages, script = PEERS[PEER]
            python = venv_python(PEER, packages)
        sides = enqueuers()
        for run in range(1, args.runs + 1):
            print(f"run {run}/{args.runs}", file=sys.stderr, flush=True)
            order = ["task", "handler"] if run % 2 else ["handler", "task"]
            record(run, "raw", "raw", raw_ceiling(args.items))
            for concurrency in concurrencies:
                for side in order:
                    record(
                        run,
                        f"w1_c{concurrency}",
                        side,
                        w1_ours(side, sides[side][0], args.items, concurrency),
                    )
            if not args.skip_peer:
                # As configured by default, then tuned: a persistent connection
                # (CONN_MAX_AGE None) and planner statistics (ANALYZE).
                for workload, max_age, extra in (
                    ("w1_peer", "0", []),
                    ("w1_peer_tuned", "none", ["analyze"]),
                ):
                    os.environ["BENCH_DJTASKS_CONN_MAX_AGE"] = max_age
                    result = run_peer(
                        python, script, fresh_database(url, PEER), "w1", str(args.items), *extra
                    )
                    del os.environ["BENCH_DJTASKS_CONN_MAX_AGE"]
                    record(
                        run,
                        workload,
                        PEER,
                        {**result, "conn_max_age": max_age, "packages": packages},
                    )
            for side in order:
                record(
                    run, "w3", side, w3_ours(side, sides[side][1], args.latency_items, args.rate)
                )
            if not args.skip_peer:
                result = run_peer(
                    python,
                    script,
                    fresh_database(url, PEER),
                    "w3",
                    str(args.latency_items),
                    str(args.rate),
                )
                record(run, "w3", PEER, {**result, "packages": packages})
    finally:
        stop_postgres()
    print(render(rows, concurrencies, time.time() - started))


# -- the table ----------------------------------------------------------------------


def values(rows: list[dict], workload: str, side: str, field: str) -> dict[int, float]:
    """Run number -> the field's value, for one workload and side."""
    return {
        r["run"]: float(r[field])
        for r in rows
        if r["workload"] == workload and r["side"] == side and r.get(field) is not None
    }


def fmt(by_run: dict[int, float], digits: int = 0, suffix: str = "") -> str:
    if not by_run:
        return "n/a"
    vals = list(by_run.values())
    median = f"{statistics.median(vals):,.{digits}f}{suffix}"
    if len(vals) == 1:
        return median
    return f"{median} ({min(vals):,.{digits}f}-{max(vals):,.{digits}f})"


def ratio(a: dict[int, float], b: dict[int, float], digits: int = 2) -> str:
    """The median over runs of a/b, each taken within its own run."""
    per_run = {run: a[run] / b[run] for run in a if b.get(run)}
    return fmt(per_run, digits, "x")


def render(rows: list[dict], concurrencies: list[int], seconds: float) -> str:
    m = machine()
    runs = len({r["run"] for r in rows})
    peer = {
        "wall": values(rows, "w1_peer", PEER, "items_per_second"),
        "active": values(rows, "w1_peer", PEER, "items_per_second_active"),
    }
    tuned = {
        "wall": values(rows, "w1_peer_tuned", PEER, "items_per_second"),
        "active": values(rows, "w1_peer_tuned", PEER, "items_per_second_active"),
    }
    lines = [
        f"Machine: {m['cpus']} cores, {m['platform']}, Python {m['python']}. "
        f"Date: {m['date']}. {runs} run(s), {seconds / 60:.0f} minutes; "
        "median (min-max); ratios are taken within each run, then their median.",
        "",
        "| measure | DBWorkerBackend `@task` | plain handler | django-tasks-db "
        "| django-tasks-db, tuned | task / handler | task / django-tasks-db "
        "| task / tuned |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def line(
        label: str,
        task: dict,
        handler: dict,
        p: dict,
        pa: dict,
        digits: int = 0,
        rdigits: int = 1,
        lower_is_better: bool = False,
    ) -> None:
        if lower_is_better:  # latency: "1 / N": the task's is N times lower
            to_peer, to_tuned = (f"1 / {ratio(p, task, 0)}" if p else "n/a"), "n/a"
        else:
            to_peer, to_tuned = ratio(task, p, rdigits), ratio(task, pa, rdigits)
        lines.append(
            f"| {label} | {fmt(task, digits)} | {fmt(handler, digits)} | {fmt(p, digits)} | "
            f"{fmt(pa, digits)} | {ratio(task, handler)} | {to_peer} | {to_tuned} |"
        )

    for c in concurrencies:
        for field, kind in (
            ("items_per_second_active", "active"),
            ("items_per_second_wall", "wall"),
        ):
            line(
                f"W1 jobs/s, --concurrency {c}, {kind}",
                values(rows, f"w1_c{c}", "task", field),
                values(rows, f"w1_c{c}", "handler", field),
                peer[kind],
                tuned[kind],
            )
    c = concurrencies[0]
    for field, label, digits, rdigits in (
        ("commits_per_item", f"W1 commits per job (--concurrency {c})", 3, 3),
        ("enqueue_in_one_transaction_per_second", "enqueue() calls/s in one transaction", 0, 2),
    ):
        line(
            label,
            values(rows, f"w1_c{c}", "task", field),
            values(rows, f"w1_c{c}", "handler", field),
            values(rows, "w1_peer", PEER, field),
            values(rows, "w1_peer_tuned", PEER, field),
            digits,
            rdigits,
        )
    for field in ("p50_ms", "p99_ms"):
        line(
            f"W3 latency {field[:3]} ms",
            values(rows, "w3", "task", field),
            values(rows, "w3", "handler", field),
            values(rows, "w3", PEER, field),
            {},
            2,
            lower_is_better=True,
        )
    raw1 = values(rows, "raw", "raw", "claim_complete_batch1_per_second")
    raw100 = values(rows, "raw", "raw", "claim_complete_batch100_per_second")
    insert = values(rows, "raw", "raw", "single_insert_per_second")
    task_c = values(rows, f"w1_c{c}", "task", "items_per_second_active")
    lines += [
        "",
        f"Raw ceiling (bench/raw_ceiling.py, same runs): single-row INSERT + commit "
        f"{fmt(insert)}/s (the machine's commit rate); claim/complete one row per "
        f"transaction {fmt(raw1)} rows/s; in batches of 100 {fmt(raw100)} rows/s. "
        f"`@task` W1 at --concurrency {c} (active) is {ratio(task_c, raw100)} the batch-100 "
        f"ceiling and {ratio(task_c, raw1, 1)} the batch-1 loop.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
