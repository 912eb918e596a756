"""Shared by the peer harnesses (stdlib only: each runs in the peer's own venv)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

URL = os.environ.get("DATABASE_URL", "")
STAMPS = Path(os.environ.get("BENCH_STAMPS", "/tmp/peer-stamps.txt"))


def emit(**result: Any) -> None:
    print(json.dumps(result), flush=True)


def stamp(key: object) -> None:
    """Called by a job when it starts: appends "key time" (atomic small append)."""
    with open(STAMPS, "a") as fh:
        fh.write(f"{key} {time.time()}\n")


def read_stamps() -> dict[str, float]:
    if not STAMPS.exists():
        return {}
    out = {}
    for line in STAMPS.read_text().splitlines():
        key, _, value = line.partition(" ")
        if value:
            out[key] = float(value)
    return out


def latency_run(
    enqueue: Callable[[], object], items: int, rate: float, start_worker: list[str]
) -> None:
    """W3: start the worker process, enqueue one at a time at ``rate``/s, measure."""
    STAMPS.unlink(missing_ok=True)
    worker = subprocess.Popen([sys.executable, *start_worker], env=dict(os.environ))
    try:
        warm = str(enqueue())
        deadline = time.monotonic() + 60
        while warm not in read_stamps():
            if time.monotonic() > deadline or worker.poll() is not None:
                raise SystemExit("the peer worker did not start")
            time.sleep(0.05)
        committed: dict[str, float] = {}
        next_at = time.monotonic()
        for _ in range(items):
            key = str(enqueue())
            committed[key] = time.time()
            next_at += 1.0 / rate
            time.sleep(max(0.0, next_at - time.monotonic()))
        deadline = time.monotonic() + 60
        while True:
            stamps = read_stamps()
            if all(k in stamps for k in committed) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        lat = sorted((stamps[k] - committed[k]) * 1000 for k in committed if k in stamps)
        emit(
            bench="w3_latency",
            items=items,
            done=len(lat),
            p50_ms=statistics.median(lat),
            p99_ms=lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))],
        )
    finally:
        worker.terminate()
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()
