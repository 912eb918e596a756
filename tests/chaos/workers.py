"""The chaos workload's handlers: one per behaviour the invariants check.

Every payload carries the item number ``n``. Handlers count their runs per
item in files under ``CHAOS_RUN_DIR/runs`` (not in the database, so a
database fault never changes what a handler decides) and append each run's
start and end to a per-process run log there, for evidence.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

from django.conf import settings

from django_dbworker import WorkItemHandler
from tests.chaos.models import Effect

STALE_AFTER = float(settings.DBWORKER["STALE_AFTER"])
#: A result PostgreSQL's jsonb refuses: the escape \u0000 has no text form.
REFUSED_TEXT = "nul\u0000byte"


def _runs_dir() -> Path:
    return Path(settings.RUN_DIR) / "runs"


def count_run(handler: str, n: int) -> int:
    """This run's number for item ``n`` (1 for the first run), across processes."""
    path = _runs_dir() / f"{handler}-{n}.count"
    with open(path, "ab") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file is closed
        fh.write(b".")
        fh.flush()
        return os.fstat(fh.fileno()).st_size


def log_run(handler: str, n: int, run: int, event: str, **extra: Any) -> None:
    line = {
        "t": round(time.time(), 3),
        "pid": os.getpid(),
        "thread": threading.current_thread().name,
        "handler": handler,
        "n": n,
        "run": run,
        "event": event,
        **extra,
    }
    fd = os.open(
        _runs_dir() / f"log-{os.getpid()}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
    )
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())  # one write: lines never interleave
    finally:
        os.close(fd)


class ChaosHandler(WorkItemHandler):
    """Counts and logs each run around ``run``."""

    abstract = True
    queue = "chaos"
    #: Room for every fault that can cost an item an attempt in a run.
    max_attempts = 25

    def handle(self, payload: Any) -> Any:
        n = int(payload["n"])
        run = count_run(self.name, n)
        log_run(self.name, n, run, "start")
        try:
            result = self.run(payload, run)
        except BaseException as exc:
            log_run(self.name, n, run, "raised", error=type(exc).__name__)
            raise
        log_run(self.name, n, run, "returned")
        return result

    def run(self, payload: Any, run: int) -> Any:
        raise NotImplementedError


class Atomic(ChaosHandler):
    """Writes one Effect row in the handler's transaction, then works a while."""

    name = "chaos_atomic"
    atomic = True

    def run(self, payload: Any, run: int) -> Any:
        Effect.objects.create(item_no=payload["n"], handler=self.name, pid=os.getpid())
        time.sleep(float(payload["seconds"]))
        return {"n": payload["n"]}


class Sleep(ChaosHandler):
    """Plain work of a given duration: milliseconds to longer than STALE_AFTER."""

    name = "chaos_sleep"

    def run(self, payload: Any, run: int) -> Any:
        time.sleep(float(payload["seconds"]))
        return {"n": payload["n"]}


class Flaky(ChaosHandler):
    """Fails its first ``fail_times`` runs with a retryable error, then succeeds."""

    name = "chaos_flaky"

    def run(self, payload: Any, run: int) -> Any:
        if run <= int(payload["fail_times"]):
            raise ConnectionError(f"flaky failure {run}/{payload['fail_times']}")
        return {"n": payload["n"]}


class _Overrun(ChaosHandler):
    """The first run overruns ``timeout``; later runs are quick.

    The abandoned first run ends later by returning or (``late = "fail"``)
    raising; either way its outcome must be discarded by fencing.
    """

    abstract = True
    overrun: ClassVar[float]

    def run(self, payload: Any, run: int) -> Any:
        if run == 1:
            time.sleep(self.overrun)
            if payload.get("late") == "fail":
                raise RuntimeError("an abandoned run failed after its timeout")
        return {"n": payload["n"]}


class TimeoutShort(_Overrun):
    name = "chaos_timeout_short"
    timeout = 1.0
    overrun = 2.5


class TimeoutLong(_Overrun):
    """A timeout longer than STALE_AFTER: heartbeats must keep the row until then."""

    name = "chaos_timeout_long"
    timeout = STALE_AFTER + 1.0
    overrun = STALE_AFTER + 3.0


class AlwaysFail(ChaosHandler):
    name = "chaos_always_fail"
    max_attempts = 3

    def run(self, payload: Any, run: int) -> Any:
        raise ValueError("always fails")


class NoRetry(ChaosHandler):
    """Raises an exception outside ``retry_on``: fails at once."""

    name = "chaos_no_retry"
    max_attempts = 5
    retry_on = (ConnectionError,)

    def run(self, payload: Any, run: int) -> Any:
        raise ValueError("not retryable")


class Refused(ChaosHandler):
    """Returns a result the database refuses to store."""

    name = "chaos_refused"
    max_attempts = 2

    def run(self, payload: Any, run: int) -> Any:
        return {"n": payload["n"], "text": REFUSED_TEXT}


class RefusedAtomic(ChaosHandler):
    """An atomic handler whose refused result must also roll back its Effect."""

    name = "chaos_refused_atomic"
    atomic = True
    max_attempts = 2

    def run(self, payload: Any, run: int) -> Any:
        Effect.objects.create(item_no=payload["n"], handler=self.name, pid=os.getpid())
        return {"n": payload["n"], "text": REFUSED_TEXT}


class Keyed(ChaosHandler):
    """One run per concurrency key at a time: its runs log their key and claim token.

    The keyed mode's checks read the run log: the runs that held a key's
    slot (the succeeded attempts, and runs cut short by their worker's
    death) must never overlap in time.
    """

    name = "chaos_keyed"
    concurrency_limit = 1

    def handle_item(self, item: Any) -> Any:
        payload = item.payload
        n = int(payload["n"])
        run = count_run(self.name, n)
        token = str(item.claim_token)
        log_run(self.name, n, run, "start", key=payload["key"], token=token)
        try:
            time.sleep(float(payload["seconds"]))
        except BaseException as exc:
            log_run(self.name, n, run, "raised", error=type(exc).__name__, token=token)
            raise
        log_run(self.name, n, run, "returned", key=payload["key"], token=token)
        return {"n": n}
