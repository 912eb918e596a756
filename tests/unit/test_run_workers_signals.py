"""run_workers' stop signals, in this process: a signal handler never waits for a lock.

Python runs a signal handler on the main thread between two bytecodes of
whatever that thread is doing, another handler included. A second signal
that came while the first one's handler was inside ``stopping.set()`` (its
condition's lock held) ran a handler that waited for that same lock: the
worker hung before its drain. Here the main thread holds the lock of the
stop event, as that handler did, when both signals arrive.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from types import FrameType

import pytest

from django_dbworker.management.commands.run_workers import Command
from django_dbworker.worker.runtime import Worker, WorkerConfig
from tests.testapp.workers import Noop

#: Seconds a signal's delivery may take before the test calls its handler stuck.
STUCK_AFTER = 5.0


class HandlerStuck(Exception):
    pass


@pytest.fixture
def own_signal_handlers() -> Iterator[None]:
    """The test's handlers for SIGTERM, SIGINT and SIGALRM, pytest's back afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM)}
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def _stuck(signum: int, frame: FrameType | None) -> None:
    # Raised inside the lock wait it interrupts: a stuck handler fails the
    # test instead of hanging the run.
    raise HandlerStuck(f"a stop signal's handler waited {STUCK_AFTER}s for a lock")


def test_a_second_signal_stops_the_worker_at_once(own_signal_handlers: None) -> None:
    worker = Worker([Noop], WorkerConfig(shutdown_timeout=120))
    stops = Command()._install_signal_handlers(worker)
    signal.signal(signal.SIGALRM, _stuck)
    signal.setitimer(signal.ITIMER_REAL, STUCK_AFTER)
    try:
        # What the first signal's handler held when the second one came.
        with worker.stopping._cond:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        stops.close()
    assert worker.aborting.wait(STUCK_AFTER), "the second signal did not stop the worker at once"
    assert worker.stopping.is_set() and worker.draining.is_set()
    assert stops.count == 2
