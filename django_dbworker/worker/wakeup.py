"""Wake-ups: an idle worker starts new work within milliseconds of an enqueue.

A thread keeps a subscription to the database's wake-up notifications
(``operations(using).listen()``: on PostgreSQL, LISTEN on a connection of
its own) and wakes the claim loop for each notified queue it serves. This
module holds the thread, its reconnects and backoff; it holds no SQL and no
driver API. Losing the subscription only costs latency: the claim loop
still polls at POLL_INTERVAL.

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
    add_local_waker,
    operations,
    parse_wake_payload,
    remove_local_waker,
)
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
    nothing is known of what is pending.
    """

    def __init__(
        self, *, using: str, queues: Sequence[str] | None, wake: Callable[[int | None], None]
    ) -> None:
        super().__init__(name="dbworker-listener", daemon=True)
        self.using = using
        self.queues = set(queues) if queues else None
        self.wake = wake
        self.stopped = threading.Event()
        self.listening = threading.Event()

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
                    for payload in subscription.receive(timeout=1.0):
                        queue, priority = parse_wake_payload(payload)
                        if self.queues is None or queue in self.queues:
                            self.wake(priority)
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

    def stop(self) -> None:
        self.stopped.set()
