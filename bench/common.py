"""Shared benchmark plumbing: a durable throwaway PostgreSQL and Django setup."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STATE = ROOT / ".tmp" / "pg-bench.json"


_started_here = False


def start_postgres() -> str:
    """Start (or reuse) the durable benchmark cluster; return its URL.

    With DATABASE_URL set, that database is used and nothing is started.
    """
    global _started_here
    if os.environ.get("DATABASE_URL"):
        return os.environ["DATABASE_URL"]
    _started_here = True
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "pgcluster.py"),
            "start",
            "--durable",
            "--state",
            str(STATE),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def stop_postgres() -> None:
    """Stop the cluster if this process started it (and BENCH_KEEP_PG is unset)."""
    if not _started_here or os.environ.get("BENCH_KEEP_PG"):
        return
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "pgcluster.py"), "stop", "--state", str(STATE)],
        check=False,
        capture_output=True,
    )


#: The peers' virtual environments under bench/.peers: compiled by their own pip.
_PEERS = re.compile(r"[/\\]\.peers[/\\]")


def compile_bytecode() -> None:
    """Write the package's bytecode caches, as an installed copy has them.

    ``pip install`` compiles a package's modules; this checkout's editable
    install does not, and with ``PYTHONDONTWRITEBYTECODE`` set (as on the
    development machine) every worker process would compile all of
    django-dbworker from source at start: 40 ms of the start-up figure
    that no installed copy pays, and that the peers (installed by pip) do
    not pay either. Quick when the caches are fresh.
    """
    import compileall

    for folder in ("django_dbworker", "bench"):
        compileall.compile_dir(str(ROOT / folder), quiet=1, rx=_PEERS)


def setup_django(url: str) -> None:
    compile_bytecode()
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    sys.path.insert(0, str(ROOT))
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def reset_table() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            # MySQL's TRUNCATE restarts AUTO_INCREMENT by itself.
            cursor.execute("TRUNCATE TABLE django_dbworker_workitem")
        else:
            cursor.execute("TRUNCATE django_dbworker_workitem RESTART IDENTITY")


def settle_table() -> None:
    """Vacuum, analyze and checkpoint the queue table (PostgreSQL): a leg starts clean.

    A leg of a few seconds that meets autovacuum or a WAL-triggered checkpoint
    of the previous leg's garbage runs at half speed on this 2-core machine;
    W7's plain leg, run after the keyed one on its table, measured from 3,900
    to 12,200 jobs/s between runs of one tree.
    """
    from django.db import connection

    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE django_dbworker_workitem")
        cursor.execute("CHECKPOINT")


def worker_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "django", "run_workers", *args]


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }


def report(name: str, result: dict[str, Any]) -> None:
    """One JSON line (for scripts) and a small table (for people)."""
    print(json.dumps({"bench": name, **result, "machine": machine()}))
    width = max(len(k) for k in result)
    for key, value in result.items():
        shown = f"{value:,.3f}" if isinstance(value, float) else str(value)
        print(f"  {key.ljust(width)}  {shown}", file=sys.stderr)


def machine_cpu() -> tuple[int, int] | None:
    """The whole machine's busy and total CPU time since boot, in clock ticks
    (Linux ``/proc/stat``; ``os.sysconf("SC_CLK_TCK")`` ticks a second).

    The difference over a leg says how busy the leg kept the machine (workers,
    server and all): a leg that leaves cores idle is waiting on a chain of
    round trips, one that fills them is short of CPU. Integers, so that a
    share of them is never above 1. None off Linux.
    """
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (which may hold spaces)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def postmaster_cpu_seconds(postmaster: int) -> float:
    """CPU seconds spent so far by a PostgreSQL cluster (Linux ``/proc``).

    The postmaster's own utime + stime, its live children's (backends,
    autovacuum, the checkpointer...), and its cutime + cstime, where the
    times of the backends that exited (a ``--burst`` worker's connections)
    end up once the postmaster reaps them.
    """
    own = _proc_stat(postmaster)
    assert own is not None, "the postmaster is gone"
    # Fields after the name: state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14).
    ticks = sum(int(v) for v in own[11:15])
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _proc_stat(int(entry))
            if fields and int(fields[1]) == postmaster:
                ticks += int(fields[11]) + int(fields[12])
    return ticks / _TICK


def database_cpu_seconds() -> float | None:
    """:func:`postmaster_cpu_seconds` of the server behind Django's connection.

    The postmaster is found from the server's own data directory (a server
    on this host, as the benchmarks' are); None where that cannot be read
    (another host, MySQL, not Linux).
    """
    from django.db import connection

    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute("SHOW data_directory")
        datadir = Path(cursor.fetchone()[0])
    try:
        pid = int((datadir / "postmaster.pid").read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None
    return postmaster_cpu_seconds(pid)


def wait_for_backends_to_exit(timeout: float = 10.0) -> None:
    """Wait (bounded) until this connection is the database's only client backend.

    An exited worker's backend may still be ending: its CPU time and its
    statistics reach the counters only once it is gone.
    """
    from django.db import connection

    if connection.vendor != "postgresql":
        return
    deadline = time.monotonic() + timeout
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
            )
            if cursor.fetchone()[0] == 0:
                return
            time.sleep(0.01)


def children_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process's children that have been waited for."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def commits() -> int:
    """Transactions committed in this database so far (all sessions).

    bench/peer_harness/djtasks_bench.py has its own copy: it runs in the
    peer's virtual environment, where this module is not importable.
    """
    from django.db import connection

    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            # Server-wide (the benchmark server serves nothing else):
            # explicit COMMITs only, so a write in autocommit is not counted.
            cursor.execute("SHOW GLOBAL STATUS LIKE 'Com_commit'")
            return int(cursor.fetchone()[1])
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )
        return int(cursor.fetchone()[0])
