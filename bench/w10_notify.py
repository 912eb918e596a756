"""W10: wake-ups under concurrent enqueue (issue 23): NOTIFY in every commit, once per window, off.

    .venv/bin/python bench/w10_notify.py [--threads 16] [--seconds 5] [--rounds 3] [--window 0.1]

``--threads`` threads, each with its own connection, call ``enqueue()`` one
item at a time in autocommit (each its own transaction) for ``--seconds``
seconds. Three modes, alternating, ``--rounds`` times: ``WAKEUP_WINDOW`` 0
(a NOTIFY inside every enqueue, as before the setting existed), the
window, and ``WAKEUPS`` off (no NOTIFY). Reports enqueues per second per
mode (each round and the median) and the NOTIFYs that a LISTEN connection
received (in a process of its own, as a worker's is: with no listener at
all, NOTIFY costs less), so that the saving is seen to come from fewer
NOTIFYs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
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


#: The counter's own process (as a worker's LISTEN is): it counts the wake-ups
#: until a NOTIFY on its stop channel, which arrives after every earlier commit's.
COUNTER = """
import sys, psycopg
conn = psycopg.connect(sys.argv[1], autocommit=True)
conn.execute("LISTEN django_dbworker")
conn.execute("LISTEN w10_stop")
print("listening", flush=True)
count = 0
for note in conn.notifies():
    if note.channel == "w10_stop":
        break
    count += 1
print(count, flush=True)
"""


class Notifies:
    """Counts the wake-ups sent, on a LISTEN connection of a process of its own."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", COUNTER, url], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "listening":
            raise SystemExit("the NOTIFY counter did not start")

    def stop(self) -> int:
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("NOTIFY w10_stop")
        out, _ = self.proc.communicate(timeout=60)
        return int(out.strip())


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
                    counter = Notifies(url)
                    done = _run(args.threads, args.seconds)
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
