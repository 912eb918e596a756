"""W10: wake-ups under concurrent enqueue (issue 23): NOTIFY in every commit, once per window, off.

    .venv/bin/python bench/w10_notify.py [--threads 16] [--seconds 5] [--rounds 3] [--window 0.1]

``--threads`` threads, each with its own connection, call ``enqueue()`` one
item at a time in autocommit (each its own transaction) for ``--seconds``
seconds. Three modes, alternating, ``--rounds`` times: ``WAKEUP_WINDOW`` 0
(a NOTIFY inside every enqueue, as before the setting existed), the
window, and ``WAKEUPS`` off (no NOTIFY). Reports enqueues per second per
mode (each round and the median) and the NOTIFYs a LISTEN connection of
its own received, so that the saving is seen to come from fewer NOTIFYs.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

from common import report, reset_table, setup_django, start_postgres, stop_postgres


def _run(threads: int, seconds: float) -> int:
    """Enqueues done by ``threads`` threads in ``seconds`` seconds."""
    from django.db import connections

    from bench.benchapp.workers import BenchNoop

    counts = [0] * threads
    errors: list[BaseException] = []
    ready = threading.Barrier(threads + 1)  # used twice: connected, then go
    deadline = [0.0]

    def enqueue(index: int) -> None:
        try:
            BenchNoop.enqueue({"n": -1})  # connect before the clock starts
            ready.wait()
            ready.wait()
            n = 0
            while time.monotonic() < deadline[0]:
                BenchNoop.enqueue({"n": n})
                n += 1
            counts[index] = n
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    workers = [threading.Thread(target=enqueue, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    ready.wait()  # every thread connected
    deadline[0] = time.monotonic() + seconds
    ready.wait()  # go
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return sum(counts)


class Notifies(threading.Thread):
    """Counts the wake-ups sent, on a LISTEN connection of its own."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        import psycopg
        from django.db import connection

        self.conn = psycopg.connect(**connection.get_connection_params(), autocommit=True)
        self.conn.execute("LISTEN django_dbworker")
        self.count = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            self.count += sum(1 for _ in self.conn.notifies(timeout=0.2))

    def stop(self) -> int:
        self.stopped.set()
        self.join()
        self.conn.close()
        return self.count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=0.1)
    args = parser.parse_args()
    url = start_postgres()
    try:
        setup_django(url)
        from django.conf import settings
        from django.test import override_settings

        modes: dict[str, dict[str, Any]] = {
            "window_0": {"WAKEUP_WINDOW": 0.0},
            f"window_{args.window:g}": {"WAKEUP_WINDOW": args.window},
            "wakeups_off": {"WAKEUPS": False},
        }
        rates: dict[str, list[float]] = {name: [] for name in modes}
        notifies: dict[str, list[int]] = {name: [] for name in modes}
        for _ in range(args.rounds):
            for name, values in modes.items():
                reset_table()
                with override_settings(DBWORKER={**settings.DBWORKER, **values}):
                    counter = Notifies()
                    counter.start()
                    done = _run(args.threads, args.seconds)
                    time.sleep(0.3)  # the last wake-ups' delivery
                    notifies[name].append(counter.stop())
                rates[name].append(done / args.seconds)
        result: dict[str, Any] = {"threads": args.threads, "seconds": args.seconds}
        for name in modes:
            result[f"{name}_per_second"] = statistics.median(rates[name])
            result[f"{name}_rounds"] = " ".join(f"{rate:.0f}" for rate in rates[name])
            result[f"{name}_notifies"] = " ".join(str(n) for n in notifies[name])
        report("w10_notify", result)
    finally:
        stop_postgres()


if __name__ == "__main__":
    main()
