"""Wake-ups: an idle worker starts new work within milliseconds of an enqueue.

A thread keeps a subscription to the database's wake-up notifications
(``operations(using).listen()``: on PostgreSQL, LISTEN on a connection of
its own) and wakes the claim loop for each notified queue it serves. This
module holds the thread, its reconnects and backoff; it holds no SQL and no
driver API. Losing the subscription only costs latency: the claim loop
still polls at POLL_INTERVAL.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from django_dbworker.db import Subscription, operations
from django_dbworker.worker.connections import Backoff

logger = logging.getLogger("django_dbworker.worker")


class Listener(threading.Thread):
    def __init__(
        self, *, using: str, queues: Sequence[str] | None, wake: Callable[[], None]
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
                # Wake once after (re)connecting: notifications sent while we
                # were not listening are lost, the rows they announced are not.
                self.wake()
                while not self.stopped.is_set():
                    for queue in subscription.receive(timeout=1.0):
                        if self.queues is None or queue in self.queues:
                            self.wake()
            except Exception as exc:
                self.listening.clear()
                if self.stopped.is_set():
                    break
                delay = backoff.next()
                logger.warning(
                    "Wake-up listener lost its connection (%s); reconnecting in %.1fs.", exc, delay
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
