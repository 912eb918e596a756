"""Handlers the suite runs in-process and in ``run_workers`` subprocesses."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from django_dbworker import Cancelled, Handler, NoTask, PeriodicHandler, WorkItemHandler, claim_next
from django_dbworker.periodic.handler import slot_key
from tests.testapp.models import Effect, Execution, Invoice


def _record(payload: Any, kind: str = "run") -> int:
    key = str(payload.get("key", "")) if isinstance(payload, dict) else str(payload)
    Execution.objects.create(key=key, kind=kind, pid=os.getpid())
    return Execution.objects.filter(key=key, kind=kind).count()


class Noop(WorkItemHandler):
    name = "noop"

    def handle(self, payload: Any) -> None:
        return None


class Echo(WorkItemHandler):
    name = "echo"
    queue = "echoes"

    def handle(self, payload: Any) -> Any:
        return payload


class Record(WorkItemHandler):
    name = "record"

    def handle(self, payload: Any) -> None:
        _record(payload)


class Sleep(WorkItemHandler):
    name = "sleep"

    def handle(self, payload: Any) -> str:
        _record(payload, "start")
        time.sleep(float(payload["seconds"]))
        _record(payload, "end")
        return "slept"


class Flaky(WorkItemHandler):
    """Fails the first ``fail_times`` runs of a key, then succeeds."""

    name = "flaky"
    max_attempts = 4

    def handle(self, payload: Any) -> int:
        runs = _record(payload)
        if runs <= int(payload["fail_times"]):
            raise ConnectionError(f"flaky failure {runs}")
        return runs


class AlwaysFail(WorkItemHandler):
    name = "always_fail"
    max_attempts = 2

    def handle(self, payload: Any) -> None:
        _record(payload)
        raise ValueError("always fails")


class NoRetry(WorkItemHandler):
    name = "no_retry"
    max_attempts = 5
    retry_on = (ConnectionError,)

    def handle(self, payload: Any) -> None:
        _record(payload)
        raise ValueError("not a retryable error")


class SystemExiter(WorkItemHandler):
    name = "system_exit"
    max_attempts = 1

    def handle(self, payload: Any) -> None:
        raise SystemExit(3)


class BadResult(WorkItemHandler):
    name = "bad_result"
    max_attempts = 1

    def handle(self, payload: Any) -> Any:
        return object()


class ReturnsCoroutine(WorkItemHandler):
    """A sync handle that forgot an ``await``: it returns a coroutine it never ran."""

    name = "returns_coroutine"
    max_attempts = 3

    def handle(self, payload: Any) -> Any:
        return _never_run(payload)


async def _never_run(payload: Any) -> None:
    _record(payload, "returns_coroutine")


class Secret(WorkItemHandler):
    name = "secret"
    sensitive = True
    max_attempts = 1

    def handle(self, payload: Any) -> None:
        raise ValueError(f"cannot use {payload['password']}")


class Slow(WorkItemHandler):
    """Runs past its timeout; records whether it ever finished."""

    name = "slow"
    timeout = 0.5
    max_attempts = 2

    def handle(self, payload: Any) -> str:
        _record(payload, "start")
        time.sleep(float(payload.get("seconds", 3)))
        _record(payload, "end")
        return "late"


class KillWorker(WorkItemHandler):
    """SIGKILLs its own worker process: ``times`` runs of a key, then succeeds."""

    name = "kill_worker"
    max_attempts = 3

    def handle(self, payload: Any) -> str:
        runs = _record(payload)
        if runs <= int(payload.get("times", 1_000_000)):
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(10)
        return "survived"


class AtomicWrite(WorkItemHandler):
    """Writes an Effect, then lingers so a test can steal the claim meanwhile."""

    name = "atomic_write"
    atomic = True

    def handle(self, payload: Any) -> str:
        _record(payload, "start")
        Effect.objects.create(key=str(payload["key"]))
        time.sleep(float(payload.get("seconds", 0)))
        return "written"


class NonAtomicLinger(WorkItemHandler):
    """Like AtomicWrite without the transaction: its late outcome must be fenced."""

    name = "linger"

    def handle(self, payload: Any) -> str:
        _record(payload, "start")
        time.sleep(float(payload.get("seconds", 0)))
        _record(payload, "end")
        return "late"


class Urgent(WorkItemHandler):
    name = "urgent"
    queue = "urgent"

    def handle(self, payload: Any) -> None:
        _record(payload)


class InvoiceMailer(Handler[Invoice]):
    """The own-table kit: claim pending invoices, mark them sent."""

    name = "invoice-mailer"
    interval = 0.2
    max_concurrency = 3

    def claim(self) -> Invoice:
        invoice = claim_next(
            Invoice.objects.filter(status="pending").order_by("id"), status="sending"
        )
        if invoice is None:
            raise NoTask
        return invoice

    def process(self, invoice: Invoice) -> None:
        Invoice.objects.filter(pk=invoice.pk).update(status="sent", sent_by=os.getpid())

    def recover_stale(self) -> None:
        Invoice.objects.filter(
            status="sending", updated_at__lt=timezone.now() - timedelta(seconds=30)
        ).update(status="pending")


class Explosive(Handler[Invoice]):
    """Raises from every hook now and then, BaseExceptions included."""

    name = "explosive"
    interval = 0.05
    max_concurrency = 2
    calls = {"claim": 0, "process": 0, "recover": 0}

    def claim(self) -> Invoice:
        Explosive.calls["claim"] += 1
        if Explosive.calls["claim"] % 3 == 0:
            raise RuntimeError("claim exploded")
        if Explosive.calls["claim"] % 5 == 0:
            raise SystemExit("claim exited")
        invoice = claim_next(
            Invoice.objects.filter(status="pending").order_by("id"), status="sending"
        )
        if invoice is None:
            raise NoTask
        return invoice

    def process(self, invoice: Invoice) -> None:
        Explosive.calls["process"] += 1
        n = Explosive.calls["process"]
        if n % 4 == 0:
            Invoice.objects.filter(pk=invoice.pk).update(status="pending")
            raise SystemExit("process exited")
        Invoice.objects.filter(pk=invoice.pk).update(status="sent")

    def recover_stale(self) -> None:
        Explosive.calls["recover"] += 1
        if Explosive.calls["recover"] % 2 == 0:
            raise KeyError("recover exploded")


# -- handlers for the fault tests (tests/integration/test_faults.py) ------------------


class OverrunOnce(WorkItemHandler):
    """Run n sleeps ``durations[n - 1]``: a first run can overrun a long timeout."""

    name = "overrun_once"
    timeout = 3.0
    max_attempts = 3

    def handle(self, payload: Any) -> int:
        runs = _record(payload, "start")
        durations = payload["durations"]
        time.sleep(float(durations[min(runs, len(durations)) - 1]))
        _record(payload, "end")
        return runs


class UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this exception cannot be printed")


class Unprintable(WorkItemHandler):
    name = "unprintable"
    max_attempts = 2

    def handle(self, payload: Any) -> None:
        _record(payload)
        raise UnprintableError()


class _BadBackoff(WorkItemHandler):
    abstract = True
    max_attempts = 2

    def handle(self, payload: Any) -> None:
        _record(payload)
        raise ConnectionError("retry me")


class RaisingBackoff(_BadBackoff):
    name = "raising_backoff"

    def backoff(self, attempt: int) -> float:
        raise ZeroDivisionError("backoff exploded")


class InfiniteBackoff(_BadBackoff):
    name = "infinite_backoff"

    def backoff(self, attempt: int) -> float:
        return float("inf")


class NanBackoff(_BadBackoff):
    name = "nan_backoff"

    def backoff(self, attempt: int) -> float:
        return float("nan")


class NulError(WorkItemHandler):
    """An error text PostgreSQL's text columns refuse."""

    name = "nul_error"
    max_attempts = 1

    def handle(self, payload: Any) -> None:
        raise ValueError("bad \x00 byte")


class NulResult(WorkItemHandler):
    """A result PostgreSQL's jsonb refuses."""

    name = "nul_result"

    def handle(self, payload: Any) -> Any:
        _record(payload)
        return {"text": "bad\x00"}


class SecretSlowFail(WorkItemHandler):
    """Sensitive, and its exception quotes the payload."""

    name = "secret_retry"
    sensitive = True
    max_attempts = 2

    def handle(self, payload: Any) -> None:
        try:
            int(payload["password"])
        except ValueError as exc:
            raise KeyError(f"password {payload['password']} refused") from exc


class LongError(WorkItemHandler):
    name = "long_error"
    max_attempts = 1

    def handle(self, payload: Any) -> None:
        raise ValueError("x" * 50_000)


# -- handlers for tests/integration/test_faults_outcome_recording.py ----------------


def _undecodable_name() -> str:
    """A file name as os.listdir()/sys.argv give it for bytes that are not UTF-8."""
    return b"report-\xff.csv".decode("utf-8", "surrogateescape")


class SurrogateErrorTimed(WorkItemHandler):
    """Raises an error whose message holds a lone surrogate; runs under a timeout."""

    name = "surrogate_error_timed"
    timeout = 10.0
    max_attempts = 1

    def handle(self, payload: Any) -> None:
        _record(payload)
        raise ValueError(f"cannot import {_undecodable_name()}")


class SurrogateErrorNoRetry(WorkItemHandler):
    """Same error, outside retry_on: must fail at once, as a ValueError."""

    name = "surrogate_error_no_retry"
    max_attempts = 3
    retry_on = (ConnectionError,)

    def handle(self, payload: Any) -> None:
        _record(payload)
        raise ValueError(f"cannot import {_undecodable_name()}")


class QuietSleep(WorkItemHandler):
    """Records its start, then sleeps and returns without touching the database."""

    name = "quiet_sleep"

    def handle(self, payload: Any) -> str:
        _record(payload, "start")
        time.sleep(float(payload.get("seconds", 0)))
        return "done"


class HugeResult(WorkItemHandler):
    """Returns valid JSON that PostgreSQL's jsonb cannot hold (a string over 256 MiB)."""

    name = "huge_result"

    def handle(self, payload: Any) -> Any:
        _record(payload)
        return {"blob": "x" * (1 << 28)}


class SlowFail(WorkItemHandler):
    """Overruns its timeout, then raises: the late failure must be fenced and counted."""

    name = "slow_fail"
    timeout = 0.3
    max_attempts = 2

    def handle(self, payload: Any) -> None:
        _record(payload, "start")
        time.sleep(float(payload.get("seconds", 1.0)))
        raise ValueError("late failure")


#: Opened by in-process tests to let ``Gate`` items finish.
GATE = threading.Event()


class Gate(WorkItemHandler):
    """Records its start; with ``wait`` in the payload, waits for ``GATE`` (10 s at most)."""

    name = "gate"

    def handle(self, payload: Any) -> None:
        _record(payload, "start")
        if payload.get("wait"):
            GATE.wait(10)


class Pace(WorkItemHandler):
    """Records its run, then sleeps ``seconds``: jobs of a chosen length."""

    name = "pace"

    def handle(self, payload: Any) -> None:
        _record(payload)
        time.sleep(float(payload.get("seconds", 0)))


class Tick(PeriodicHandler):
    """Every second; records its slot, so tests can count runs per slot."""

    name = "tick"
    every = 1

    def run(self, slot: datetime) -> str:
        Execution.objects.create(key=slot_key(slot), kind="tick", pid=os.getpid())
        return slot_key(slot)


class SlowTick(PeriodicHandler):
    """Every second, each run longer than two slots: the next slots are skipped."""

    name = "slow_tick"
    every = 1

    def run(self) -> None:
        assert self.slot is not None
        Execution.objects.create(key=slot_key(self.slot), kind="slow_tick", pid=os.getpid())
        time.sleep(float(os.environ.get("DBWORKER_TEST_SLOW_TICK", "2.2")))


class Nightly(PeriodicHandler):
    """03:00 in Paris; reads its slot from ``self.slot``."""

    name = "nightly"
    cron = "0 3 * * *"
    timezone = "Europe/Paris"
    queue = "reports"

    def run(self) -> dict[str, str]:
        assert self.slot is not None
        Execution.objects.create(key=slot_key(self.slot), kind="nightly", pid=os.getpid())
        return {"report_for": slot_key(self.slot)}


class Rated(WorkItemHandler):
    """Rate-limited: at most 20 starts in any second, cluster-wide; records each start."""

    name = "rated"
    queue = "rated"
    rate_limit = "20/s"

    def handle(self, payload: Any) -> float:
        started = time.time()  # the start, before anything waits for the database
        _record(payload, "rated")
        return started


class RatedSlowly(WorkItemHandler):
    """Rate-limited to 2 starts a minute: after two, the rest wait (integration tests)."""

    name = "rated_slowly"
    rate_limit = "2/m"

    def handle(self, payload: Any) -> None:
        _record(payload, "rated_slowly")


class Paused(WorkItemHandler):
    """Runs in its own queue, ``pausable``; records each run (pause tests)."""

    name = "pausable"
    queue = "pausable"

    def handle(self, payload: Any) -> None:
        _record(payload, "pausable")


if os.environ.get("DBWORKER_TEST_CLAIMLESS"):
    # Only in the subprocess of the start-up test: every other run_workers
    # without names would refuse to start because of it.

    class Claimless(Handler[Invoice]):
        """An own-table handler that forgot ``claim``: run_workers refuses it at start-up."""

        name = "claimless"

        def process(self, invoice: Invoice) -> None:
            pass


class Keyed(WorkItemHandler):
    """At most one item per concurrency key at once: records its start and end, then sleeps.

    The records carry the item's ``key`` (its concurrency key, by the tests'
    convention), so that a key's records read start, end, start, end, ...
    in time order exactly when no two of its runs overlapped.
    """

    name = "keyed"
    concurrency_limit = 1

    def handle_item(self, item: Any) -> None:
        payload = item.payload
        _record(payload, "start")
        # ``first_seconds``: how long the first attempt runs (one that its
        # worker's SIGKILL ends), the later ones run ``seconds``.
        seconds = payload.get("first_seconds") if item.attempts == 1 else None
        time.sleep(float(payload.get("seconds", 0) if seconds is None else seconds))
        _record(payload, "end")


class KeyedPair(WorkItemHandler):
    """Two items per concurrency key at once; does nothing."""

    name = "keyed_pair"
    concurrency_limit = 2

    def handle(self, payload: Any) -> None:
        return None


class StopWhenCancelled(WorkItemHandler):
    """Loops until its cancel request arrives (Execution kinds "run", then "saw-cancel")."""

    name = "stop_when_cancelled"
    max_attempts = 3

    def handle(self, payload: Any) -> None:
        _record(payload)
        deadline = time.monotonic() + float(payload.get("seconds", 60))
        while not self.cancel_requested:
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        _record(payload, kind="saw-cancel")
        raise RuntimeError("stopped: cancel requested")


class SnoozeOnce(WorkItemHandler):
    """Snoozes its first run for ``seconds``, succeeds on the next one."""

    name = "snooze_once"
    max_attempts = 1

    def handle(self, payload: Any) -> int:
        runs = _record(payload)
        if runs == 1:
            from django_dbworker import Snooze

            raise Snooze(float(payload.get("seconds", 1.0)))
        return runs


class OverrunAfterCancel(WorkItemHandler):
    """Sees its cancel request, carries on past its timeout, then returns (too late)."""

    name = "overrun_after_cancel"
    timeout = 1.0
    max_attempts = 3

    def handle(self, payload: Any) -> str:
        _record(payload)
        deadline = time.monotonic() + 30
        while not self.cancel_requested and time.monotonic() < deadline:
            time.sleep(0.02)
        _record(payload, kind="saw-cancel" if self.cancel_requested else "no-cancel")
        time.sleep(1.5)  # past the timeout: the attempt is abandoned meanwhile
        _record(payload, kind="late")
        return "too late"


class IgnoresCancelOnFirstRun(WorkItemHandler):
    """First run: notes the cancel request ("saw-cancel") but keeps running, up to 60 s.

    A later run (the row came back: released, recovered) returns at once.
    It never raises: only the worker's own bookkeeping decides how a
    cancel-requested row ends (a request outliving its attempt).
    """

    name = "ignores_cancel_on_first_run"
    max_attempts = 3

    def handle(self, payload: Any) -> str:
        runs = _record(payload)
        if runs > 1:
            return f"run {runs}"
        noted = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.cancel_requested and not noted:
                _record(payload, "saw-cancel")
                noted = True
            time.sleep(0.05)
        return "first run done"


def _long_call(should_stop: Any, seconds: float) -> bool:
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
    (``lambda: self.cancel_requested``, the README's former pattern, reads
    the calling thread's attempt: always False there.)
    """

    name = "passes_check_to_long_call"
    max_attempts = 3

    def handle(self, payload: Any) -> str:
        _record(payload)
        with ThreadPoolExecutor(max_workers=1) as pool:
            stopped = pool.submit(
                _long_call, self.cancel_check, float(payload.get("seconds", 8))
            ).result()
        if stopped:
            raise Cancelled("the long call stopped as asked")
        if self.cancel_requested:
            _record(payload, "main-saw")
        return "the long call never saw the request"


class BatchDone(WorkItemHandler):
    """A batch's callback: records its payload's counts under the key ``batch:<id>``."""

    name = "batch_done"

    def handle(self, payload: Any) -> dict[str, Any]:
        _record({"key": f"batch:{payload['batch']}"}, "callback")
        return payload


class Step(WorkItemHandler):
    """Records its start and its end, sleeping ``seconds`` between; with ``fail`` in the
    payload it then raises a ValueError, which it does not retry (fails for good). With
    ``gate``, it waits (30 s at most) between the two for an Execution of that key and
    kind "open", which the test writes.

    The batch and ``after=`` process tests (tests/process/test_batches.py)
    read the order of the runs from these records.
    """

    name = "step"
    max_attempts = 5
    retry_on = (ConnectionError,)

    def handle(self, payload: Any) -> None:
        _record(payload, "start")
        time.sleep(float(payload.get("seconds", 0)))
        if payload.get("gate"):
            deadline = time.monotonic() + 30
            gate = Execution.objects.filter(key=payload["gate"], kind="open")
            while not gate.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        _record(payload, "end")
        if payload.get("fail"):
            raise ValueError(f"step {payload['key']} fails for good")


async def _arecord(payload: Any, kind: str) -> int:
    """``_record`` from a coroutine, through Django's thread for sync code."""
    from asgiref.sync import sync_to_async

    return await sync_to_async(_record)(payload, kind)


class AsyncSleep(WorkItemHandler):
    """An async handler (on the worker's event loop): records its start, awaits
    ``asyncio.sleep(seconds)``, records its end. Each record is an Execution whose
    ``created_at`` shows when it ran (tests/process/test_async_handlers.py)."""

    name = "async_sleep"

    async def handle(self, payload: Any) -> dict[str, Any]:
        import asyncio

        await _arecord(payload, "start")
        await asyncio.sleep(float(payload.get("seconds", 0)))
        await _arecord(payload, "end")
        return {"slept": payload.get("seconds", 0)}


class AsyncTimed(AsyncSleep):
    """``AsyncSleep`` with a 1 s timeout: a longer sleep is cancelled, its end never recorded."""

    name = "async_timed"
    timeout = 1.0
    max_attempts = 1


class AsyncKeyed(AsyncSleep):
    """``AsyncSleep``, one item per concurrency key at a time, at most 4 starts a second."""

    name = "async_keyed"
    concurrency_limit = 1
    rate_limit = "4/s"


class AsyncBlocks(WorkItemHandler):
    """An async handler that wrongly calls blocking code: ``time.sleep`` holds the loop."""

    name = "async_blocks"

    async def handle(self, payload: Any) -> None:
        time.sleep(float(payload["seconds"]))
