"""pgqueuer through W1/W2/W3 (run with bench/.peers/pgqueuer's python)."""

from __future__ import annotations

import asyncio
import sys
import time

import psycopg
from peer_common import URL, emit, latency_run, stamp
from pgqueuer import PgQueuer
from pgqueuer.db import PsycopgDriver
from pgqueuer.queries import Queries
from pgqueuer.types import QueueExecutionMode


async def connect() -> psycopg.AsyncConnection:
    return await psycopg.AsyncConnection.connect(URL, autocommit=True)


async def queries() -> Queries:
    q = Queries(PsycopgDriver(await connect()))
    if not await q.schema_is_installed():
        await q.install()
    return q


def make_app(conn: psycopg.AsyncConnection, record: bool) -> PgQueuer:
    pgq = PgQueuer.from_psycopg_connection(conn)

    @pgq.entrypoint("noop")
    async def noop(job: object) -> None:
        if record:
            stamp(job.id)  # type: ignore[attr-defined]

    return pgq


async def w1(items: int) -> None:
    q = await queries()
    for start in range(0, items, 1000):
        n = min(1000, items - start)
        await q.enqueue(["noop"] * n, [None] * n, [0] * n)
    pgq = make_app(await connect(), record=False)
    started = time.perf_counter()
    await pgq.run(mode=QueueExecutionMode.drain)  # its defaults: batches of 10
    elapsed = time.perf_counter() - started
    emit(bench="w1_throughput", items=items, items_per_second=items / elapsed)


async def w2(single: int, many: int) -> None:
    q = await queries()
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


async def worker() -> None:
    pgq = make_app(await connect(), record=True)
    await pgq.run()


def main() -> None:
    mode = sys.argv[1]
    if mode == "w1":
        asyncio.run(w1(int(sys.argv[2])))
    elif mode == "w2":
        asyncio.run(w2(int(sys.argv[2]), int(sys.argv[3])))
    elif mode == "worker":
        asyncio.run(worker())
    elif mode == "w3":
        asyncio.run(queries())
        conn = psycopg.connect(URL, autocommit=True)
        from pgqueuer.db import SyncPsycopgDriver
        from pgqueuer.queries import SyncQueries

        sq = SyncQueries(SyncPsycopgDriver(conn))
        latency_run(
            lambda: sq.enqueue("noop", None)[0],
            int(sys.argv[2]),
            float(sys.argv[3]),
            [__file__, "worker"],
        )


if __name__ == "__main__":
    main()
