"""Plumbing of the scale benchmarks (issue 23): the cluster, its CPU and its counters.

The ``scale_*.py`` scripts run on a durable cluster of their own
(``.tmp/pg-scale-<script>.json``, so that they never share one with
``run_all.py`` or with each other)
with ``pg_stat_statements`` loaded: ``scripts/pgcluster.py`` does not load
it, so :func:`start_cluster` sets ``shared_preload_libraries`` with ALTER
SYSTEM and restarts the server once. What the database spends is read from
the server itself:

* CPU: ``/proc/<pid>/stat`` of the postmaster and its children (utime +
  stime), plus the postmaster's ``cutime`` + ``cstime``, where the times of
  the backends that exited (a ``--burst`` worker's connections) end up once
  the postmaster reaps them;
* transactions and rows: ``pg_stat_database`` (a backend flushes these at
  most once a second while busy, within about 10 s when idle, and always
  when it exits);
* WAL: ``pg_current_wal_lsn()`` (the whole cluster's, autovacuum's too);
* statements: ``pg_stat_statements`` (counted in shared memory as each
  statement ends: exact and immediate), the measuring connection's own
  queries left out (they all name ``pg_stat``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from common import ROOT, postmaster_cpu_seconds

#: The cluster's state file: BENCH_SCALE_STATE, or one per script (:func:`use_state`).
STATE = Path(os.environ.get("BENCH_SCALE_STATE", ROOT / ".tmp" / "pg-scale.json"))
PGCLUSTER = ROOT / "scripts" / "pgcluster.py"
#: Transaction control, counted apart from the queries themselves.
CONTROL = ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE")


def use_state(name: str) -> None:
    """Give this script a cluster of its own, ``.tmp/pg-scale-<name>.json``."""
    global STATE
    if not os.environ.get("BENCH_SCALE_STATE"):
        STATE = ROOT / ".tmp" / f"pg-scale-{name}.json"


def _pgcluster(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(PGCLUSTER), *args, "--state", str(STATE)],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def start_cluster(*, lock_log_ms: int = 100) -> str:
    """Start (or reuse) the durable scale cluster with pg_stat_statements; return its URL.

    ``log_lock_waits`` is on, with ``deadlock_timeout`` at ``lock_log_ms``:
    every lock wait longer than that is logged with its duration
    (:func:`lock_waits_logged` reads them).
    """
    url = _pgcluster("start", "--durable")
    with psycopg.connect(url, autocommit=True) as conn:
        loaded = conn.execute("SHOW shared_preload_libraries").fetchone()
        if not loaded or "pg_stat_statements" not in str(loaded[0]):
            conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
            conn.execute("ALTER SYSTEM SET log_lock_waits = on")
            conn.execute(f"ALTER SYSTEM SET deadlock_timeout = '{lock_log_ms}ms'")
            restart = True
        else:
            restart = False
    if restart:
        _pgcluster("restart")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    return url


def stop_cluster() -> None:
    """Stop and remove the scale cluster (unless BENCH_KEEP_PG is set)."""
    if os.environ.get("BENCH_KEEP_PG"):
        return
    subprocess.run(
        [sys.executable, str(PGCLUSTER), "stop", "--state", str(STATE)],
        check=False,
        capture_output=True,
    )


def cluster_info() -> dict[str, Any]:
    return json.loads(STATE.read_text())  # type: ignore[no-any-return]


def server_log() -> Path:
    return Path(str(cluster_info()["base"])) / "server.log"


def postmaster_pid() -> int:
    datadir = Path(str(cluster_info()["datadir"]))
    return int((datadir / "postmaster.pid").read_text().splitlines()[0])


def server_cpu_seconds() -> float:
    """CPU seconds spent so far by the cluster: the postmaster, its children, and the reaped."""
    return postmaster_cpu_seconds(postmaster_pid())


@dataclass
class Snapshot:
    """The counters of one moment: transactions, rows, statements, CPU."""

    at: float
    cpu: float
    db: dict[str, int]
    statements: dict[int, tuple[str, int]] = field(default_factory=dict)

    def delta(self, before: Snapshot) -> dict[str, Any]:
        calls = {
            qid: (query, n - before.statements.get(qid, ("", 0))[1])
            for qid, (query, n) in self.statements.items()
        }
        calls = {qid: qc for qid, qc in calls.items() if qc[1] > 0}
        control = sum(n for q, n in calls.values() if q.lstrip().upper().startswith(CONTROL))
        return {
            "seconds": self.at - before.at,
            "server_cpu_seconds": self.cpu - before.cpu,
            **{k: self.db[k] - before.db[k] for k in self.db},
            "statements": sum(n for _, n in calls.values()),
            "statements_control": control,
            # Claim statements that ran, found rows or not (the claim's CTE: postgresql_sql).
            "claims": sum(
                n
                for q, n in calls.values()
                if "FOR UPDATE SKIP LOCKED" in q and q.lstrip().startswith("WITH c AS MATERIALIZED")
            ),
            "top": sorted(calls.values(), key=lambda qc: -qc[1])[:12],
        }


DB_COUNTERS = (
    "xact_commit",
    "xact_rollback",
    "tup_returned",
    "tup_fetched",
    "tup_inserted",
    "tup_updated",
    "tup_deleted",
)


def snapshot(url: str) -> Snapshot:
    """Read the counters on a connection of its own (its own queries name pg_stat)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            f"SELECT {', '.join(DB_COUNTERS)}, "
            "pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint AS wal_bytes "
            "FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        assert row is not None
        statements = {
            int(qid): (str(query), int(calls))
            for qid, query, calls in conn.execute(
                "SELECT queryid, query, calls FROM pg_stat_statements s "
                "JOIN pg_database d ON d.oid = s.dbid AND d.datname = current_database() "
                "WHERE query NOT ILIKE '%pg_stat%' AND queryid IS NOT NULL"
            ).fetchall()
        }
        cpu = server_cpu_seconds()
        return Snapshot(
            at=time.perf_counter(),
            cpu=cpu,
            db=dict(zip((*DB_COUNTERS, "wal_bytes"), (int(v) for v in row), strict=True)),
            statements=statements,
        )


def client_backends(url: str) -> int:
    """Client connections to this database, the asking one left out."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
        ).fetchone()
        assert row is not None
        return int(row[0])


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def commit_hash() -> str:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip()


def stop_processes(procs: list[subprocess.Popen[bytes]], timeout: float = 60.0) -> list[int]:
    """SIGTERM each (by its PID), wait for all, SIGKILL what is left; return the exit codes."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    return codes
