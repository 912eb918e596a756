"""The faults of a chaos run, each injected on the runner's own cluster and workers.

Every fault targets processes by PID (the PostgreSQL server's from its
``postmaster.pid`` and ``/proc``, the workers' from ``processes.py``) or
database sessions by ``application_name``; none looks anything up by name.
Each injector undoes itself in a ``finally`` (thaw, resume, writable again),
so an interrupted run leaves nothing frozen or read-only.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.chaos.processes import ROOT, WorkerProc, WorkerSet

#: Every fault of the schedule; short mode injects each at least once.
FAULTS = ("kill_worker", "kill_connections", "freeze_database", "freeze_worker", "read_only")

PGCLUSTER = (sys.executable, str(ROOT / "scripts" / "pgcluster.py"))

WHAT = {
    "kill_worker": "SIGKILL a worker process, start a replacement",
    "kill_connections": "pg_terminate_backend() every worker connection",
    "freeze_database": "SIGSTOP every server process, longer than STALE_AFTER",
    "freeze_worker": "SIGSTOP one worker process, longer than STALE_AFTER",
    "read_only": "default_transaction_read_only = on for a few seconds (ALTER SYSTEM)",
}


@dataclass
class Injected:
    fault: str
    start: float  # time.time(): the host clock, which the database shares
    end: float
    detail: str


class Cluster:
    """The runner's own throwaway PostgreSQL (scripts/pgcluster.py)."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.url = ""
        self.info: dict[str, object] = {}

    def start(self) -> str:
        out = subprocess.run(
            [*PGCLUSTER, "start", "--state", str(self.state)],
            check=True,
            capture_output=True,
            text=True,
            timeout=180,
        )
        self.url = out.stdout.strip().splitlines()[-1]
        self.info = json.loads(self.state.read_text())
        return self.url

    def stop(self) -> None:
        if not self.state.exists():
            return
        self.thaw_all()  # a stopped postmaster cannot shut down
        subprocess.run(
            [*PGCLUSTER, "stop", "--state", str(self.state)],
            check=False,
            capture_output=True,
            timeout=120,
        )

    @property
    def datadir(self) -> Path:
        return Path(str(self.info["datadir"]))

    def postmaster_pid(self) -> int:
        pid = int((self.datadir / "postmaster.pid").read_text().splitlines()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if str(self.datadir).encode() not in cmdline:  # a recycled PID is not ours
            raise RuntimeError(f"pid {pid} from postmaster.pid is not this cluster's server")
        return pid

    def server_pids(self) -> list[int]:
        """The postmaster, then its children (backends and auxiliary processes)."""
        pm = self.postmaster_pid()
        return [pm, *children(pm)]

    def thaw_all(self) -> None:
        try:
            pids = self.server_pids()
        except (OSError, RuntimeError, ValueError, IndexError):
            return
        for pid in reversed(pids):
            _signal(pid, signal.SIGCONT)


def children(ppid: int) -> list[int]:
    """PIDs whose parent is ``ppid``, from /proc (no process names involved)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces or parentheses: fields follow the last ")".
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == ppid:
            found.append(int(entry))
    return sorted(found)


def _signal(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return False
    return True


class FaultInjector:
    """Injects one named fault at a time; returns what it did and when."""

    def __init__(
        self,
        *,
        cluster: Cluster,
        workers: WorkerSet,
        rng: random.Random,
        stale_after: float,
        execute_sql: Callable[..., list[tuple[object, ...]]],
        worker_application_name: str,
        on_replaced: Callable[[WorkerProc, WorkerProc], None],
    ) -> None:
        self.cluster = cluster
        self.workers = workers
        self.rng = rng
        self.stale_after = stale_after
        self.sql = execute_sql
        self.app_name = worker_application_name
        self.on_replaced = on_replaced
        self.is_read_only = False

    def inject(self, fault: str) -> Injected:
        action = {
            "kill_worker": self.kill_worker,
            "kill_connections": self.kill_connections,
            "freeze_database": self.freeze_database,
            "freeze_worker": self.freeze_worker,
            "read_only": self.read_only,
        }[fault]
        start = time.time()
        detail = action()
        return Injected(fault, start, time.time(), detail)

    def _pick_worker(self) -> WorkerProc | None:
        live = self.workers.live()
        return self.rng.choice(live) if live else None

    # -- the faults: each returns a one-line description ---------------------------

    def kill_worker(self) -> str:
        victim = self._pick_worker()
        if victim is None:
            return "no live worker"
        victim.ending = "sigkill"
        victim.signal(signal.SIGKILL)
        victim.wait(10)
        replacement = self.workers.start()
        self.on_replaced(victim, replacement)
        return f"killed {victim.name}, started {replacement.name}"

    def kill_connections(self) -> str:
        rows = self.sql(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = %s AND pid <> pg_backend_pid()",
            (self.app_name,),
        )
        return f"terminated {rows[0][0]} worker backend(s)"

    def freeze_database(self) -> str:
        pause = round(self.stale_after + self.rng.uniform(1.0, 2.0), 2)
        with self._frozen_server() as count:
            time.sleep(pause)  # the fault itself: a server that does not answer
        return f"SIGSTOP {count} server processes for {pause}s"

    def freeze_worker(self) -> str:
        victim = self._pick_worker()
        if victim is None:
            return "no live worker"
        pause = round(self.stale_after + self.rng.uniform(1.5, 3.0), 2)
        victim.signal(signal.SIGSTOP)
        victim.frozen = True
        try:
            time.sleep(pause)  # the fault itself: a worker that stopped running
        finally:
            victim.signal(signal.SIGCONT)
            victim.frozen = False
        return f"SIGSTOP {victim.name} for {pause}s"

    def read_only(self) -> str:
        pause = round(self.rng.uniform(2.5, 4.0), 2)
        self.set_read_only(True)
        try:
            time.sleep(pause)  # the fault itself: a database that refuses writes
        finally:
            self.set_read_only(False)
        return f"read-only for {pause}s"

    # -- helpers ---------------------------------------------------------------------

    def set_read_only(self, on: bool) -> None:
        # ALTER SYSTEM is allowed in a read-only session, and the runner's own
        # session is started with default_transaction_read_only=off anyway.
        if on:
            self.sql("ALTER SYSTEM SET default_transaction_read_only = on")
        else:
            self.sql("ALTER SYSTEM RESET default_transaction_read_only")
        self.sql("SELECT pg_reload_conf()")
        self.is_read_only = on

    @contextmanager
    def _frozen_server(self) -> Iterator[int]:
        stopped: list[int] = []
        try:
            # The postmaster first, so that it forks nothing while its children stop.
            pm = self.cluster.postmaster_pid()
            if _signal(pm, signal.SIGSTOP):
                stopped.append(pm)
            for pid in children(pm):
                if _signal(pid, signal.SIGSTOP):
                    stopped.append(pid)
            yield len(stopped)
        finally:
            for pid in reversed(stopped):
                _signal(pid, signal.SIGCONT)
