"""The ``run_workers`` subprocesses of a chaos run: start, watch, replace, stop.

Processes are only ever signalled by the PIDs this module started. Each
worker dies with the runner (``PR_SET_PDEATHSIG``), so a runner killed
without its cleanup leaves no worker behind.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class WorkerProc:
    """One ``python -m django run_workers`` process and its log."""

    seq: int
    role: str  # "worker" (long-running) or "burst" (the final --burst run)
    args: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes]
    started: float = field(default_factory=time.time)
    ended: float | None = None
    returncode: int | None = None
    #: Why it ended, from the runner's point of view: "sigkill" (a fault),
    #: "sigterm" (the orderly stop), "forced" (no exit after SIGTERM), "exited"
    #: (by itself: a crash, an unhealthy worker giving up, or --burst done).
    ending: str = ""
    frozen: bool = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def name(self) -> str:
        return f"{self.role}-{self.seq} (pid {self.pid})"

    def poll(self) -> int | None:
        rc = self.proc.poll()
        if rc is not None and self.returncode is None:
            self.returncode = rc
            self.ended = time.time()
        return rc

    def alive(self) -> bool:
        return self.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            self.proc.send_signal(signum)

    def wait(self, timeout: float) -> int | None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        return self.poll()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log().splitlines()[-lines:])


class WorkerSet:
    """Every worker process of a run, live or ended, in start order."""

    def __init__(
        self, *, handlers: Sequence[str], concurrency: int, env: dict[str, str], log_dir: Path
    ) -> None:
        self.handlers = list(handlers)
        self.concurrency = concurrency
        self.env = env
        self.log_dir = log_dir
        self.procs: list[WorkerProc] = []

    def start(self, role: str = "worker", extra: Sequence[str] = ()) -> WorkerProc:
        seq = len(self.procs) + 1
        args = [*self.handlers, "--concurrency", str(self.concurrency), *extra]
        log_path = self.log_dir / f"{role}-{seq}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "django", "run_workers", *args],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,  # the runner has no other threads
            )
        worker = WorkerProc(seq, role, args, log_path, proc)
        self.procs.append(worker)
        return worker

    def live(self, role: str = "worker") -> list[WorkerProc]:
        return [p for p in self.procs if p.role == role and p.alive()]

    def by_pid(self) -> dict[int, WorkerProc]:
        return {p.pid: p for p in self.procs}

    def wait_started(self, procs: Sequence[WorkerProc], timeout: float) -> None:
        """Wait until each process logged its start line; raise if one exits first."""
        deadline = time.monotonic() + timeout
        pending = list(procs)
        while pending:
            for p in list(pending):
                if "Starting worker:" in p.log():
                    pending.remove(p)
                elif not p.alive():
                    raise RuntimeError(
                        f"{p.name} exited ({p.returncode}) before starting:\n{p.log_tail(30)}"
                    )
            if pending and time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                raise RuntimeError(f"{names} did not start within {timeout:g}s")
            if pending:
                time.sleep(0.1)

    def stop(self, procs: Sequence[WorkerProc], timeout: float) -> None:
        """SIGTERM, wait up to ``timeout`` for all, SIGKILL the ones still running."""
        for p in procs:
            if p.frozen:
                p.signal(signal.SIGCONT)
                p.frozen = False
            if p.alive():
                p.ending = "sigterm"
                p.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            if p.wait(max(0.0, deadline - time.monotonic())) is None:
                p.ending = "forced"
                p.signal(signal.SIGKILL)
                p.wait(10)

    def kill_all(self) -> None:
        """Emergency cleanup: SIGKILL every process this set started that still runs."""
        for p in self.procs:
            if p.alive():
                p.signal(signal.SIGCONT)
                p.signal(signal.SIGKILL)
                p.wait(10)
                p.ending = p.ending or "cleanup"
