"""Benchmark handlers: no work at all, so the queue itself is what is measured."""

from __future__ import annotations

import os
import time
from typing import Any

from django_dbworker import WorkItemHandler


class BenchNoop(WorkItemHandler):
    """No work; or, with a payload ``{"ms": N}``, N milliseconds of sleep (W7's job length)."""

    name = "bench_noop"

    def handle(self, payload: Any) -> None:
        if payload:
            time.sleep(payload["ms"] / 1000.0)


class BenchLatency(WorkItemHandler):
    """Returns the wall-clock time at which the handler started."""

    name = "bench_latency"

    def handle(self, payload: Any) -> float:
        return time.time()


class BenchSleep(WorkItemHandler):
    """Sleeps ``payload["seconds"]``: the bulk work an urgent item arrives behind (W6)."""

    name = "bench_sleep"

    def handle(self, payload: Any) -> None:
        time.sleep(float(payload["seconds"]))


class BenchRated(WorkItemHandler):
    """Rate-limited (``BENCH_RATE_LIMIT``, default 200/s); returns the time it started (W8)."""

    name = "bench_rated"
    rate_limit = os.environ.get("BENCH_RATE_LIMIT", "200/s")

    def handle(self, payload: Any) -> float:
        return time.time()


class BenchKeyed(WorkItemHandler):
    """``BenchNoop``, one item per concurrency key at a time (W7)."""

    name = "bench_keyed"
    concurrency_limit = 1

    def handle(self, payload: Any) -> None:
        if payload:
            time.sleep(payload["ms"] / 1000.0)


class BenchBatchDone(WorkItemHandler):
    """A batch's callback (W9): no work; the benchmark reads when it was enqueued."""

    name = "bench_batch_done"

    def handle(self, payload: Any) -> None:
        return None


class BenchAsyncSleep(WorkItemHandler):
    """``await asyncio.sleep(payload["seconds"])`` on the worker's event loop (W11); with
    no payload, a no-op that returns the time it started (W11's W1 and W3 legs)."""

    name = "bench_async"

    async def handle(self, payload: Any) -> float:
        import asyncio

        started = time.time()
        if payload:
            await asyncio.sleep(float(payload["seconds"]))
        return started
