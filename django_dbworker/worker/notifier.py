"""Handlers' ``attempt_recorded`` hooks, run where they can hold nobody up.

The success writer records the successes of every handler of a process,
and the claim loop recovers stale rows for all of them; a hook is user
code (a Django ``task_finished`` receiver sends an e-mail, calls a web
service), so neither thread may wait for it. They hand the calls to one
notifier thread, in order. Only handlers that have a hook pay for it.
Inline (``testing.run_until_empty``), the calls run at once, in the
caller's thread, so a test sees the signals when the run returns.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from django_dbworker.worker.connections import close_thread_connections

logger = logging.getLogger("django_dbworker.worker")


class Notifier:
    def __init__(self, *, inline: bool = False) -> None:
        self.inline = inline
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, call: Callable[[], None]) -> None:
        """Run ``call`` in the notifier thread (at once if inline, closed or the thread is gone)."""
        with self._lock:
            direct = self.inline or self._closed
            if not direct:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="dbworker-notifier", daemon=True
                    )
                    self._thread.start()
                direct = not self._thread.is_alive()
            if not direct:
                self._queue.put(call)
                return
        _call(call)

    def close(self, timeout: float) -> None:
        """Run what is queued (waiting up to ``timeout`` seconds), then stop."""
        with self._lock:
            self._closed = True
            thread = self._thread
            if thread is not None:
                self._queue.put(None)
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                logger.warning(
                    "attempt_recorded hooks still running after %.0fs at stop; not waiting.",
                    timeout,
                )

    def _run(self) -> None:
        try:
            while (call := self._queue.get()) is not None:
                _call(call)
        finally:
            close_thread_connections()


def _call(call: Callable[[], None]) -> None:
    try:
        call()
    except BaseException:  # a hook must never take a thread of the worker down
        logger.exception("An attempt_recorded hook raised.")
