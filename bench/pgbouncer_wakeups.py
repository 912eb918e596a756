"""Pick-up latency through PgBouncer in transaction mode, with and without WAKEUP_DATABASE.

    .venv/bin/python bench/pgbouncer_wakeups.py [--poll 30] [--items 10]

Starts a throwaway cluster and a PgBouncer 1.18 in transaction mode in
front of it (``scripts/pgcluster.py``, ``scripts/pgbouncer.py``), then,
twice, one idle ``run_workers`` (the test suite's settings and ``record``
handler; DATABASE_URL through the pooler, the alias ``direct`` straight to
the cluster) with POLL_INTERVAL ``--poll``: once with WAKEUP_DATABASE
``direct``, once without it. Once the worker has logged its probe's
outcome, ``--items`` items are enqueued through the pooler one at a time,
each after the previous one succeeded; pick-up is the row's claimed_at
minus its created_at (both the database's clock). Issue 23: without
WAKEUP_DATABASE the wake-ups are lost and each item waits for a poll.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def run(*args: str) -> str:
    return subprocess.run([PY, *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def measure(env: dict[str, str], items: int, poll: float) -> list[float]:
    from bench.benchapp.workers import BenchNoop
    from django_dbworker.models import WorkItem

    WorkItem.objects.all().delete()
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        cmd = [PY, "-m", "django", "run_workers", "bench_noop", "-v", "2"]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while "Wake-ups reach" not in (text := Path(log.name).read_text()) and (
                "Wake-ups cannot reach" not in text
            ):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit(f"the worker did not report its probe:\n{text}")
                time.sleep(0.05)
            latencies = []
            for i in range(items):
                item = BenchNoop.enqueue({"n": i})
                deadline = time.monotonic() + 2 * poll + 10
                while WorkItem.objects.get(pk=item.pk).status != "succeeded":
                    if time.monotonic() > deadline:
                        raise SystemExit("an item did not succeed within two poll intervals")
                    time.sleep(0.005)
                row = WorkItem.objects.get(pk=item.pk)
                assert row.claimed_at is not None
                latencies.append((row.claimed_at - row.created_at).total_seconds() * 1000)
        finally:
            proc.terminate()
            proc.wait(60)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--poll", type=float, default=30.0)
    parser.add_argument("--items", type=int, default=10)
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="dbworker-bench-"))
    pg, bouncer = state / "pg.json", state / "bouncer.json"
    try:
        direct = run("scripts/pgcluster.py", "start", "--state", str(pg)).strip()
        pooled = run(
            "scripts/pgbouncer.py", "start", "--state", str(bouncer), "--upstream-state", str(pg)
        ).strip()
        import psycopg

        with psycopg.connect(direct, autocommit=True) as conn:
            conn.execute("CREATE DATABASE dbworker_bouncer")
        os.environ.update(
            DATABASE_URL=pooled,
            BENCH_DIRECT_URL=direct,
            DJANGO_SETTINGS_MODULE="bench.settings",
        )
        sys.path.insert(0, str(ROOT))
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        env = {
            **os.environ,
            "BENCH_POLL_INTERVAL": str(args.poll),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(ROOT),
        }
        results = {}
        for name, extra in (
            ("WAKEUP_DATABASE direct", {"BENCH_WAKEUP_DATABASE": "direct"}),
            ("WAKEUP_DATABASE unset", {}),
        ):
            ms = measure({**env, **extra}, args.items, args.poll)
            results[name] = {
                "items": len(ms),
                "p50_ms": round(statistics.median(ms), 1),
                "max_ms": round(max(ms), 1),
                "min_ms": round(min(ms), 1),
            }
        print(json.dumps({"poll_interval": args.poll, "results": results}, indent=2))
    finally:
        run("scripts/pgbouncer.py", "stop", "--state", str(bouncer))
        run("scripts/pgcluster.py", "stop", "--state", str(pg))


if __name__ == "__main__":
    main()
