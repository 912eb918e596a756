"""Forcing an interleaving of transactions: threads that own their connections.

``Held`` runs a step in its own thread inside a transaction and keeps that
transaction open until the test releases it (a finisher "after its write,
before its commit"). ``Racer`` runs a step in its own thread to the end.
``lock_waiters`` tells, from the test's own connection, that a racer is
blocked on a row lock, so the test releases the holder only once the racer
is inside the contended statement. Every wait is bounded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from django.db import connections, transaction

from tests.conftest import lock_waiters, wait_until

TIMEOUT = 30.0


class _Step(threading.Thread):
    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None

    def outcome(self) -> Any:
        """Join the thread (bounded); re-raise what the step raised; return its result."""
        self.join(TIMEOUT)
        assert not self.is_alive(), "the step did not end"
        if self.error is not None:
            raise self.error
        return self.result


class Held(_Step):
    """``fn`` in a transaction of its own, left open until ``release()``.

    ``session``: statements run on the thread's connection before the
    transaction starts (a project's session settings).
    """

    def __init__(self, fn: Callable[[], Any], *, session: Callable[[], None] | None = None):
        super().__init__(fn)
        self.session = session
        self.written = threading.Event()
        self._release = threading.Event()
        self.start()
        assert self.written.wait(TIMEOUT), "the held step did not get to its commit"
        if self.error is not None:
            raise self.error

    def run(self) -> None:
        try:
            if self.session is not None:
                self.session()
            with transaction.atomic():
                self.result = self.fn()
                self.written.set()
                assert self._release.wait(TIMEOUT), "never released"
        except BaseException as exc:  # handed to the test by outcome()
            self.error = exc
        finally:
            self.written.set()
            connections.close_all()

    def release(self) -> Any:
        self._release.set()
        return self.outcome()


class Racer(_Step):
    """``fn`` in a thread of its own, as it runs in production (its own transactions)."""

    def __init__(self, fn: Callable[[], Any], *, session: Callable[[], None] | None = None):
        super().__init__(fn)
        self.session = session
        self.start()

    def run(self) -> None:
        try:
            if self.session is not None:
                self.session()
            self.result = self.fn()
        except BaseException as exc:  # handed to the test by outcome()
            self.error = exc
        finally:
            connections.close_all()


def wait_for_lock_waiters(n: int = 1, racer: _Step | None = None) -> None:
    """Until ``n`` transactions wait for a lock (or ``racer`` ended early: its error shows)."""
    wait_until(
        lambda: lock_waiters() >= n or (racer is not None and not racer.is_alive()),
        timeout=TIMEOUT,
        # InnoDB refreshes information_schema.innodb_trx only when it was not
        # read for 0.1 s: polled faster, it never changes.
        interval=0.25,
        what=f"{n} transaction(s) waiting for a row lock",
    )
    if racer is not None and not racer.is_alive():
        racer.outcome()
        raise AssertionError("the racer ended without waiting for the lock")
