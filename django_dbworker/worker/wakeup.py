"""LISTEN/NOTIFY wake-ups: an idle worker starts new work within milliseconds.

A dedicated connection (outside Django's per-thread connections, in
autocommit) LISTENs on the channel that enqueue notifies at commit. Losing
it only costs latency: the claim loop still polls at POLL_INTERVAL.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from django.db import connections

from django_dbworker.db.base import NOTIFY_CHANNEL
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

    def _connect(self) -> Any:
        wrapper = connections[self.using]
        conn = wrapper.get_new_connection(wrapper.get_connection_params())
        conn.autocommit = True
        conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
        return conn

    def run(self) -> None:
        backoff = Backoff(first=0.5, cap=10.0)
        while not self.stopped.is_set():
            conn = None
            try:
                conn = self._connect()
                self.listening.set()
                backoff.reset()
                # Wake once after (re)connecting: notifications sent while we
                # were not listening are lost, the rows they announced are not.
                self.wake()
                while not self.stopped.is_set():
                    for note in conn.notifies(timeout=1.0):
                        if self.queues is None or note.payload in self.queues:
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
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:
                        logger.debug("Ignoring an error closing the listener.", exc_info=True)

    def stop(self) -> None:
        self.stopped.set()
