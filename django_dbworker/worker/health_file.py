"""The health file: a worker's "I am alive and claiming" for a supervisor to probe.

Kubernetes' liveness probes, Docker's HEALTHCHECK and monitoring agents ask
a process from outside whether it still works; a worker cannot answer on a
port without a web server, and its exit status only speaks once it exits.
So ``run_workers --health-file PATH`` keeps a small JSON file fresh while
the worker is healthy, and ``manage.py dbworker_health --file PATH``
answers the probe from the file's age.

Fresh means both: the watchdog finds every helper thread alive and under
its cap of abandoned threads (``Watchdog.check``), and the claim loop began
a cycle recently (a claim hung on a lock or a dead connection stops it).
The loop cycles at least once a poll interval while idle and once a backoff
(at most 10 s) while the database is away, so an outage alone does not make
the file stale: restarting every worker because the database restarts helps
nobody, and the worker recovers by itself. The file is written to a
temporary file and renamed, so a probe never reads half of it, and removed
when the worker stops. The temporary file gets a random name, created
exclusively (``mkstemp``: no planted link at a name another user could
guess is ever followed, in a shared directory such as /tmp), and the rename
replaces whatever is at the path, a link included, with the worker's file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import tempfile
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

logger = logging.getLogger("django_dbworker.worker")

#: Seconds a claim loop cycle may take beyond the poll interval (and the
#: claim backoff's cap) before the worker stops calling itself healthy.
CYCLE_SLACK = 30.0
#: Most seconds between two writes (fewer with a shorter HEARTBEAT_INTERVAL);
#: a probe's ``--max-age`` should be a few of these.
HEALTH_FILE_INTERVAL = 5.0


class _Watchdog(Protocol):
    unhealthy: str | None

    def check(self) -> bool: ...


class _ClaimLoop(Protocol):
    cycled_at: float


class _Config(Protocol):
    poll_interval: float


class _Clock(Protocol):
    def now(self) -> float: ...


def worker_problem(
    watchdog: _Watchdog, claim_loop: _ClaimLoop | None, config: _Config, clock: _Clock
) -> Callable[[], str | None]:
    """What ``HealthFile`` asks: why this worker is not healthy now, or None."""

    def problem() -> str | None:
        if not watchdog.check():
            return watchdog.unhealthy or "the worker is stopping"
        if claim_loop is None:
            return None
        quiet = clock.now() - claim_loop.cycled_at
        if quiet > config.poll_interval + CYCLE_SLACK:
            return f"the claim loop has not begun a cycle for {quiet:.0f} s"
        return None

    return problem


class HealthFile(threading.Thread):
    """Rewrites ``path`` every ``interval`` seconds while ``healthy()`` says so."""

    def __init__(
        self,
        path: str,
        *,
        interval: float,
        problem: Callable[[], str | None],
        stopping: threading.Event,
    ) -> None:
        # Not a daemon: the interpreter waits for it at exit, so the file is
        # gone when the process is (a stopping worker sets ``stopping``, and
        # this thread then removes the file and ends at once). As a daemon it
        # raced the exit and, once the exit got fast, left the file behind.
        super().__init__(name="dbworker-health-file", daemon=False)
        self.path = Path(path)
        self.interval = interval
        #: None when healthy, else why not (logged once per change).
        self.problem = problem
        self.stopping = stopping
        self._complained: str | None = None

    def run(self) -> None:
        try:
            while True:
                self.write_once()
                if self.stopping.wait(self.interval):
                    return
        finally:
            self.remove()

    def write_once(self) -> bool:
        """Write the file if healthy; return whether it was written."""
        problem = self.problem()
        if problem is not None:
            self._complain(f"not refreshing the health file {self.path}: {problem}")
            return False
        body = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "updated_at": datetime.now(UTC).isoformat(),
        }
        try:
            self._replace(json.dumps(body) + "\n")
        except OSError as exc:
            self._complain(f"cannot write the health file {self.path}: {exc}")
            return False
        if self._complained is not None:
            logger.info("Health file %s is being refreshed again.", self.path)
            self._complained = None
        return True

    def _replace(self, text: str) -> None:
        """``text`` at the path, all at once, through a temporary file only this call made."""
        fd, temporary = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as file:
                file.write(text)
            os.replace(temporary, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise

    def remove(self) -> None:
        """A stopped worker is not healthy: take the file away."""
        try:
            self.path.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("Could not remove the health file %s: %s", self.path, exc)

    def _complain(self, message: str) -> None:
        if message != self._complained:
            logger.warning("%s.", message[:1].upper() + message[1:])
            self._complained = message
