"""procrastinate through W1/W2/W3 (run with bench/.peers/procrastinate's python)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time

import procrastinate
from peer_common import URL, emit, latency_run, stamp

CONCURRENCY = 8
app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=URL))
RECORD = sys.argv[1:2] == ["worker"]


@app.task(name="noop")
async def noop(key: str = "") -> None:
    if RECORD:
        stamp(key)


@app.task(name="sleep1")
async def sleep1() -> None:
    await asyncio.sleep(1)


def install() -> None:
    with app.open(), contextlib.suppress(Exception):  # already installed
        app.schema_manager.apply_schema()


def main() -> None:
    mode = sys.argv[1]
    if mode == "worker":
        app.run_worker(concurrency=CONCURRENCY, wait=True, install_signal_handlers=True)
        return
    install()
    if mode == "w1":
        items = int(sys.argv[2])
        with app.open():
            for start in range(0, items, 1000):
                noop.batch_defer(*[{} for _ in range(min(1000, items - start))])
        started = time.perf_counter()
        app.run_worker(concurrency=CONCURRENCY, wait=False)
        emit(
            bench="w1_throughput",
            items=items,
            items_per_second=items / (time.perf_counter() - started),
        )
    elif mode == "w11":
        # W11 (bench/w11_async.py): one-second async sleeps; concurrency is argv[3]
        # (procrastinate's default is 1; its docs say to raise it for I/O-bound tasks).
        items, concurrency = int(sys.argv[2]), int(sys.argv[3])
        with app.open():
            for start in range(0, items, 1000):
                sleep1.batch_defer(*[{} for _ in range(min(1000, items - start))])
        started = time.perf_counter()
        app.run_worker(concurrency=concurrency, wait=False)
        emit(bench="w11", items=items, items_per_second=items / (time.perf_counter() - started))
    elif mode == "w2":
        single, many = int(sys.argv[2]), int(sys.argv[3])
        with app.open():
            started = time.perf_counter()
            for _ in range(single):
                noop.defer()
            single_rate = single / (time.perf_counter() - started)
            started = time.perf_counter()
            noop.batch_defer(*[{} for _ in range(many)])
            emit(
                bench="w2_enqueue",
                single_per_second=single_rate,
                many_per_second=many / (time.perf_counter() - started),
            )
    elif mode == "w3":
        counter = iter(range(10**9))
        with app.open():

            def enqueue() -> str:
                key = f"k{next(counter)}"
                noop.defer(key=key)
                return key

            latency_run(enqueue, int(sys.argv[2]), float(sys.argv[3]), [__file__, "worker"])


if __name__ == "__main__":
    main()
