"""Handlers of the cancel/snooze attack tests (tests/attack/test_cancel_attack.py).

Not a ``workers`` module of an installed app: ``tests/attack/run_workers.py``
imports it before it starts ``run_workers``, and the tests import it to
enqueue, so nothing here touches the shared test app.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django_dbworker import Cancelled, WorkItemHandler
from tests.testapp.models import Execution


def record(key: str, kind: str = "run") -> int:
    Execution.objects.create(key=key, kind=kind, pid=os.getpid())
    return Execution.objects.filter(key=key, kind=kind).count()


def flag(key: str, kind: str) -> bool:
    return Execution.objects.filter(key=key, kind=kind).exists()


class IgnoresCancelOnFirstRun(WorkItemHandler):
    """First run: notes the cancel request ("saw-cancel") but keeps running, up to 60 s.

    A later run (the row came back: released, recovered) returns at once.
    It never raises: only the worker's own bookkeeping decides how a
    cancel-requested row ends.
    """

    name = "atk_ignores_cancel"
    max_attempts = 3

    def handle(self, payload: Any) -> str:
        key = payload["key"]
        runs = record(key)
        if runs > 1:
            return f"run {runs}"
        noted = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.cancel_requested and not noted:
                record(key, "saw-cancel")
                noted = True
            time.sleep(0.05)
        return "first run done"


def long_call(should_stop: Any, seconds: float) -> bool:
    """A library's long call that takes a stop check: True if told to stop in time."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if should_stop():
            return True
        time.sleep(0.02)
    return False


class PassesCheckToLongCall(WorkItemHandler):
    """The README's pattern: ``upload(path, should_stop=self.cancel_check)``.

    The long call runs its work (and so its stop checks) on a thread of its
    own, as transfer managers and client libraries with progress callbacks do.
    (The attack passed ``lambda: self.cancel_requested``, the README's former
    pattern, which reads the calling thread's attempt: always False there.)
    """

    name = "atk_long_call"
    max_attempts = 3

    def handle(self, payload: Any) -> str:
        key = payload["key"]
        record(key)
        with ThreadPoolExecutor(max_workers=1) as pool:
            stopped = pool.submit(
                long_call, self.cancel_check, float(payload.get("seconds", 8))
            ).result()
        if stopped:
            raise Cancelled("the long call stopped as asked")
        if self.cancel_requested:
            record(key, "main-saw")
        return "the long call never saw the request"
