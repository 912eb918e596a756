"""Wake-ups: an idle worker starts new work within milliseconds of an enqueue.

A thread keeps a subscription to the database's wake-up notifications
(``operations(using).listen()``: on PostgreSQL, LISTEN on a connection of
its own) and wakes the claim loop for each notified queue it serves. This
module holds the thread, its reconnects and backoff; it holds no SQL and no
driver API. Losing the subscription only costs latency: the claim loop
still polls at POLL_INTERVAL.

With WAKEUP_WINDOW above 0, enqueuers send at most one wake-up per queue per
window (``db/wake_window.py``); the listener then wakes the loop once more
that long after the last wake-up it received (the trailing claim), which
finds the rows whose wake-ups were skipped. With WAKEUPS off nothing is
listened for: the loop polls adaptively, as on MySQL.

Where the database has no such notifications (SQLite, MySQL), an enqueue
committed in the worker's own process wakes it at once (``LocalWaker``);
on MySQL the claim loop also polls adaptively (``AdaptivePoll``: often for
a moment after a claim that found work, backing off to POLL_INTERVAL when
idle). Not on SQLite, where every poll takes the database's write lock.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

from django_dbworker.db import (
    Subscription,
    VendorOperations,
    add_local_waker,
    operations,
    parse_wake_payload,
    remove_local_waker,
)
from django_dbworker.worker.config import WorkerConfig
from django_dbworker.worker.connections import Backoff, outage, report_error

logger = logging.getLogger("django_dbworker.worker")

#: Seconds between polls while work keeps coming: for BUSY_WINDOW seconds
#: after a claim that found work, then doubling up to POLL_INTERVAL.
FIRST_POLL = 0.01
#: How long after the last claim that found work the loop keeps polling at
#: FIRST_POLL, in seconds.
BUSY_WINDOW = 1.0


class AdaptivePoll:
    """How long the idle claim loop waits before it polls again, without notifications.

    Work tends to come in bursts: right after a claim found rows, more are
    likely to arrive, and short waits find them with little latency. For
    ``window`` seconds after the last claim that found work the loop polls
    every ``first`` seconds (each poll is one indexed query that usually
    finds nothing: cheap, and only while work is flowing); after that the
    wait doubles at each empty poll up to POLL_INTERVAL, so a quiet queue
    costs one query per interval per worker. Where notifications wake the
    loop, or polls are not cheap (``enabled`` False:
    ``VendorOperations.poll_adaptively``), it always waits POLL_INTERVAL.
    """

    def __init__(
        self,
        cap: float,
        *,
        enabled: bool,
        first: float = FIRST_POLL,
        window: float = BUSY_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cap = cap
        self.enabled = enabled
        self.first = min(first, cap)
        self.window = window
        self.clock = clock
        self.delay = cap
        self.last_work = -math.inf

    def found_work(self) -> None:
        if self.enabled:
            self.last_work = self.clock()
            self.delay = self.first

    def next(self) -> float:
        """The wait before the next poll (a wake-up may end it sooner)."""
        if not self.enabled:
            return self.cap
        if self.clock() - self.last_work < self.window:
            return self.first
        delay = self.delay
        self.delay = min(self.cap, delay * 2)
        return delay


def polls_adaptively(ops: VendorOperations, wakeups: bool) -> bool:
    """Whether the idle loop polls adaptively: where the vendor asks, or LISTEN is off."""
    return ops.poll_adaptively or (ops.supports_notify and not wakeups)


class LocalWaker:
    """Wakes the claim loop when this process commits an enqueue for one of its queues.

    The database cannot tell other processes; this process knows of its own
    enqueues (``VendorOperations.notify``), for instance a handler enqueueing
    follow-up work.
    """

    def __init__(self, *, queues: Sequence[str] | None, wake: Callable[[], None]) -> None:
        self.queues = set(queues) if queues else None
        self.wake = wake

    def __call__(self, queues: Sequence[str]) -> None:
        if self.queues is None or not self.queues.isdisjoint(queues):
            self.wake()

    def start(self) -> None:
        add_local_waker(self)

    def stop(self) -> None:
        remove_local_waker(self)


class Listener(threading.Thread):
    """Wakes the claim loop for each wake-up of a queue it serves, with the row's priority.

    ``wake(priority)``: the priority the wake-up announced (0 when it names
    none), or None after a reconnect, when wake-ups may have been missed and
    nothing is known of what is pending. With a ``window`` (WAKEUP_WINDOW),
    ``window`` seconds after the last wake-up received it wakes the loop
    once more with the highest priority announced since (the trailing
    claim): an enqueuer skips wake-ups for that long after one it sent.
    """

    def __init__(
        self,
        *,
        using: str,
        queues: Sequence[str] | None,
        wake: Callable[[int | None], None],
        window: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name="dbworker-listener", daemon=True)
        self.using = using
        self.queues = set(queues) if queues else None
        self.wake = wake
        self.window = window
        self.clock = clock
        #: When the trailing claim is due, and the priority it announces.
        self._trailing: tuple[float, int] | None = None
        self.stopped = threading.Event()
        self.listening = threading.Event()

    @classmethod
    def of(cls, config: WorkerConfig, *, wake: Callable[[int | None], None]) -> Listener:
        """The listener of a worker told ``config``: its alias, queues and WAKEUP_WINDOW."""
        return cls(using=config.using, queues=config.queues, wake=wake, window=config.wakeup_window)

    def run(self) -> None:
        ops = operations(self.using)
        backoff = Backoff(first=0.5, cap=10.0)
        while not self.stopped.is_set():
            subscription: Subscription | None = None
            try:
                subscription = ops.listen()
                self.listening.set()
                backoff.reset()
                outage.back(self.using, reached=True)
                # Wake once after (re)connecting: notifications sent while we
                # were not listening are lost, the rows they announced are not.
                self.wake(None)
                while not self.stopped.is_set():
                    self._receive(subscription)
            except Exception as exc:
                self.listening.clear()
                if self.stopped.is_set():
                    break
                delay = backoff.next()
                if not report_error(self.using, "wake-up listener", exc):
                    logger.warning(
                        "Wake-up listener lost its connection (%s); reconnecting in %.1fs.",
                        exc,
                        delay,
                    )
                self.stopped.wait(delay)
            finally:
                if subscription is not None:
                    try:
                        subscription.close()
                    except Exception:
                        logger.debug("Ignoring an error closing the listener.", exc_info=True)

    def _receive(self, subscription: Subscription) -> None:
        """Wake the loop for what arrives within a second (or until the trailing claim)."""
        trailing = self._trailing
        timeout = 1.0 if trailing is None else min(1.0, max(0.0, trailing[0] - self.clock()))
        for payload in subscription.receive(timeout=timeout):
            queue, priority = parse_wake_payload(payload)
            if self.queues is None or queue in self.queues:
                self.wake(priority)
                if self.window > 0:
                    top = priority if trailing is None else max(priority, trailing[1])
                    self._trailing = (self.clock() + self.window, top)
                    break  # wait again, until the new trailing claim at most
        trailing = self._trailing
        if trailing is not None and self.clock() >= trailing[0]:
            self._trailing = None
            self.wake(trailing[1])

    def stop(self) -> None:
        self.stopped.set()
