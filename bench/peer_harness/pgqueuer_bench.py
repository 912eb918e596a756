"""pgqueuer through W1/W2/W3/W6 and start-up (run with bench/.peers/pgqueuer's python).

pgqueuer at its best, as its README leads: the asyncpg driver
(``PgQueuer(AsyncpgDriver(await asyncpg.connect(...)))`` in a factory) and
workers started with its CLI, ``python -m pgqueuer run
pgqueuer_bench:FACTORY`` (the ``pgq run`` command), at the CLI's defaults:
``--batch-size 10``, ``--dequeue-timeout 30``, ``--heartbeat-timeout 30``,
no ``--max-concurrent-tasks`` (unlimited), uvloop (a pgqueuer dependency,
which the CLI uses when installed). W1 and the one-item start-up run add
``--mode drain`` (exit once the queue is empty); W3, W6 and the first-job
start-up run use the default ``--mode continuous``.

Modes (``python pgqueuer_bench.py MODE ARGS``):

``w1 ITEMS``
    ITEMS no-op jobs enqueued in bulk (not timed), then one worker process
    in drain mode. *whole*: spawning the process to its exit (interpreter,
    imports, connecting, schema check, the work, shutdown). *active*: the
    first handler start to the last handler end, from the handlers' own
    clocks (written by the worker at exit).
``w2 SINGLE MANY``
    ``Queries.enqueue`` one job per call (autocommit: one transaction each),
    then MANY jobs in one call, through asyncpg.
``w3 ITEMS RATE``
    an idle continuous worker; jobs enqueued one at a time at RATE/s;
    enqueue commit to handler start.
``w6 BACKLOG URGENT RATE JOB_MS``
    BACKLOG priority-0 jobs that each block for JOB_MS in
    ``await asyncio.to_thread(time.sleep, ...)`` (pgqueuer refuses sync
    entrypoints and its error message prescribes ``asyncio.to_thread`` for
    blocking code), one continuous worker draining them; once 300 are done,
    URGENT priority-10 jobs enqueued one at a time at RATE/s; enqueue commit
    to handler start (the bench/w6_priority.py workload).
``startup RUNS``
    per run, one no-op job: *first job*, spawning a continuous worker to the
    job's handler finishing; *burst*, a drain-mode worker for one job, spawn
    to exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import asyncpg
from peer_common import STAMPS, URL, emit, latency_run, read_stamps, stamp
from pgqueuer import PgQueuer
from pgqueuer.db import AsyncpgDriver
from pgqueuer.models import Job
from pgqueuer.queries import Queries

SPAN = STAMPS.with_name(STAMPS.name + ".span.json")
#: The worker command line: pgqueuer's own CLI (``pgq run``) on a factory of this module.
CLI = [sys.executable, "-m", "pgqueuer", "run"]
#: W6 enqueues its urgent jobs once this many backlog jobs are done (the worker is draining).
DRAINING = 300


# ---- factories (run inside the ``pgq run`` worker process) ---------------------------
# pgqueuer 1.6's CLI wants a factory that returns an async context manager.


@contextlib.asynccontextmanager
async def w1_app() -> AsyncIterator[PgQueuer]:
    """No-op jobs; the handlers' first start / last end / count are written at the end."""
    connection = await asyncpg.connect(URL)
    pgq = PgQueuer(AsyncpgDriver(connection))
    span = {"first": 0.0, "last": 0.0, "count": 0}

    @pgq.entrypoint("noop")
    async def noop(job: Job) -> None:
        now = time.time()
        if not span["count"]:
            span["first"] = now
        span["count"] += 1
        span["last"] = time.time()

    try:
        yield pgq
    finally:
        SPAN.write_text(json.dumps(span))
        await connection.close()


@contextlib.asynccontextmanager
async def w11_app() -> AsyncIterator[PgQueuer]:
    """W11: "sleep1" awaits asyncio.sleep(1); first start / last end / count written at exit."""
    connection = await asyncpg.connect(URL)
    pgq = PgQueuer(AsyncpgDriver(connection))
    span = {"first": 0.0, "last": 0.0, "count": 0}

    @pgq.entrypoint("sleep1")
    async def sleep1(job: Job) -> None:
        if not span["count"]:
            span["first"] = time.time()
        span["count"] += 1
        await asyncio.sleep(1)
        span["last"] = time.time()

    try:
        yield pgq
    finally:
        SPAN.write_text(json.dumps(span))
        await connection.close()


@contextlib.asynccontextmanager
async def latency_app() -> AsyncIterator[PgQueuer]:
    """W3/W6/start-up: "noop" stamps its start; "sleep" blocks BENCH_JOB_MS in a thread."""
    connection = await asyncpg.connect(URL)
    pgq = PgQueuer(AsyncpgDriver(connection))
    seconds = float(os.environ.get("BENCH_JOB_MS", "0")) / 1000.0

    @pgq.entrypoint("noop")
    async def noop(job: Job) -> None:
        stamp(job.id)

    @pgq.entrypoint("sleep")
    async def sleep(job: Job) -> None:
        await asyncio.to_thread(time.sleep, seconds)

    try:
        yield pgq
    finally:
        await connection.close()


# ---- the measuring side --------------------------------------------------------------


async def queries() -> Queries:
    q = Queries(AsyncpgDriver(await asyncpg.connect(URL)))
    if not await q.schema_is_installed():
        await q.install()
    return q


async def enqueue_bulk(q: Queries, entrypoint: str, items: int, priority: int = 0) -> None:
    for start in range(0, items, 5000):
        n = min(5000, items - start)
        await q.enqueue([entrypoint] * n, [None] * n, [priority] * n)


async def count(q: Queries, table: str, where: str) -> int:
    settings = q.qbe.settings
    name = settings.queue_table if table == "queue" else settings.queue_table_log
    rows = await q.driver.fetch(f"SELECT count(*) AS n FROM {name} WHERE {where}")
    return int(rows[0]["n"])


async def truncate(q: Queries) -> None:
    await q.clear_queue()
    await q.clear_queue_log()


async def w1(items: int) -> None:
    q = await queries()
    await truncate(q)
    await enqueue_bulk(q, "noop", items)
    SPAN.unlink(missing_ok=True)
    started = time.perf_counter()
    code = subprocess.call([*CLI, "pgqueuer_bench:w1_app", "--mode", "drain"])
    whole = time.perf_counter() - started
    span = json.loads(SPAN.read_text())
    left = await count(q, "queue", "TRUE")
    active = span["last"] - span["first"]
    emit(
        bench="w1_throughput",
        items=items,
        handled=span["count"],
        left_in_queue=left,
        exit_code=code,
        whole_seconds=whole,
        items_per_second_whole=items / whole,
        active_seconds=active,
        items_per_second_active=items / active,
    )
    if code or span["count"] != items or left:
        raise SystemExit("not every job ran")


async def w11(items: int) -> None:
    """W11 (bench/w11_async.py): ITEMS one-second async sleeps, one drain-mode worker at the
    CLI's defaults (no concurrency limit); the measuring side counts the connections."""
    q = await queries()
    await truncate(q)
    await enqueue_bulk(q, "sleep1", items)
    SPAN.unlink(missing_ok=True)
    started = time.perf_counter()
    code = subprocess.call([*CLI, "pgqueuer_bench:w11_app", "--mode", "drain"])
    whole = time.perf_counter() - started
    span = json.loads(SPAN.read_text())
    emit(
        bench="w11",
        items=items,
        handled=span["count"],
        exit_code=code,
        items_per_second_whole=items / whole,
        items_per_second=items / (span["last"] - span["first"]),
    )


async def w2(single: int, many: int) -> None:
    q = await queries()
    await truncate(q)
    started = time.perf_counter()
    for _ in range(single):
        await q.enqueue("noop", None)
    single_rate = single / (time.perf_counter() - started)
    started = time.perf_counter()
    await q.enqueue(["noop"] * many, [None] * many, [0] * many)
    emit(
        bench="w2_enqueue",
        single_per_second=single_rate,
        many_per_second=many / (time.perf_counter() - started),
    )


def w3(items: int, rate: float) -> None:
    loop = asyncio.new_event_loop()
    q = loop.run_until_complete(queries())
    loop.run_until_complete(truncate(q))
    latency_run(
        lambda: loop.run_until_complete(q.enqueue("noop", None))[0],
        items,
        rate,
        ["-m", "pgqueuer", "run", "pgqueuer_bench:latency_app"],
    )


async def stamped(keys: list[str]) -> bool:
    stamps = read_stamps()
    return all(k in stamps for k in keys)


async def wait_for(
    predicate: Callable[[], Awaitable[bool]], what: str, timeout: float, proc: subprocess.Popen
) -> None:
    """Until ``predicate()`` holds: a bounded wait that fails if the worker exits."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit(f"pgqueuer: {what} did not happen")
        await asyncio.sleep(0.05)


async def w6(backlog: int, urgent: int, rate: float, job_ms: float) -> None:
    q = await queries()
    await truncate(q)
    await enqueue_bulk(q, "sleep", backlog, priority=0)
    STAMPS.unlink(missing_ok=True)
    env = dict(os.environ, BENCH_JOB_MS=str(job_ms))
    proc = subprocess.Popen([*CLI, "pgqueuer_bench:latency_app"], env=env)
    try:

        async def draining() -> bool:
            return await count(q, "log", "status = 'successful'") >= DRAINING

        await wait_for(draining, "draining the backlog", 60, proc)
        committed: dict[str, float] = {}
        next_at = time.monotonic()
        for _ in range(urgent):
            (job_id,) = await q.enqueue("noop", None, priority=10)  # its own transaction
            committed[str(job_id)] = time.time()
            next_at += 1.0 / rate
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        await wait_for(
            functools.partial(stamped, list(committed)), "running the urgent jobs", 120, proc
        )
        queued = await count(q, "queue", "entrypoint = 'sleep' AND status = 'queued'")
        picked = await count(q, "queue", "entrypoint = 'sleep' AND status = 'picked'")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    stamps = read_stamps()
    lat = sorted((stamps[k] - committed[k]) * 1000.0 for k in committed)
    emit(
        bench="w6_priority",
        backlog=backlog,
        job_ms=job_ms,
        urgent=urgent,
        backlog_left_queued=queued,
        backlog_left_picked=picked,
        p50_ms=statistics.median(lat),
        p99_ms=lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))],
        max_ms=lat[-1],
        min_ms=lat[0],
    )


async def startup(runs: int) -> None:
    q = await queries()
    first_job: list[float] = []
    burst: list[float] = []
    for _ in range(runs):
        await truncate(q)
        STAMPS.unlink(missing_ok=True)
        (job_id,) = await q.enqueue("noop", None)
        spawned = time.time()
        proc = subprocess.Popen([*CLI, "pgqueuer_bench:latency_app"])
        try:
            await wait_for(functools.partial(stamped, [str(job_id)]), "the first job", 60, proc)
        finally:
            proc.terminate()
            proc.wait(30)
        first_job.append(read_stamps()[str(job_id)] - spawned)

        await truncate(q)
        await q.enqueue("noop", None)
        started = time.perf_counter()
        subprocess.run([*CLI, "pgqueuer_bench:latency_app", "--mode", "drain"], check=True)
        burst.append(time.perf_counter() - started)
        if await count(q, "queue", "TRUE"):
            raise SystemExit("pgqueuer: the drain-mode worker left its job")
    emit(
        bench="startup",
        runs=runs,
        first_job_s_median=statistics.median(first_job),
        first_job_s_min=min(first_job),
        burst_one_s_median=statistics.median(burst),
        burst_one_s_min=min(burst),
    )


def main() -> None:
    os.chdir(Path(__file__).resolve().parent)  # ``pgq run`` imports this module from here
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "w1":
        asyncio.run(w1(int(args[0])))
    elif mode == "w2":
        asyncio.run(w2(int(args[0]), int(args[1])))
    elif mode == "w3":
        w3(int(args[0]), float(args[1]))
    elif mode == "w6":
        asyncio.run(w6(int(args[0]), int(args[1]), float(args[2]), float(args[3])))
    elif mode == "startup":
        asyncio.run(startup(int(args[0])))
    elif mode == "w11":
        asyncio.run(w11(int(args[0])))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
