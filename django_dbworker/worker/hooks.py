"""The hook runner: handlers' ``attempt_recorded`` hooks, run where they can hold nobody up.

The success writer records the successes of every handler of a process,
and the claim loop recovers stale rows for all of them; a hook is user
code (a Django ``task_finished`` receiver sends an e-mail, calls a web
service), so neither thread may wait for it. ``settle.py`` hands those
calls to one hook thread, in order. Only handlers that have a hook pay for
it. Inline (``testing.run_until_empty``: ``InlineHookRunner``), the calls
run at once, in the caller's thread, so a test sees the signals when the
run returns.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from django_dbworker.worker.connections import close_thread_connections

logger = logging.getLogger("django_dbworker.worker")


class HookRunner:
    """One thread, started on first use, that runs queued hook calls in order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, call: Callable[[], None]) -> None:
        """Run ``call`` in the hook thread (at once if closed or the thread is gone)."""
        with self._lock:
            direct = self._closed
            if not direct:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="dbworker-hooks", daemon=True
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


class InlineHookRunner(HookRunner):
    """Runs every hook call at once, in the calling thread."""

    def submit(self, call: Callable[[], None]) -> None:
        _call(call)
