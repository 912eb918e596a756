"""A fixed pool of daemon threads with slot accounting.

Unlike ``ThreadPoolExecutor`` its threads are daemons, so a stopping worker
that has released its rows can exit without waiting for abandoned user
code, and its counts (free threads, tasks queued) are what the claim loops
size their batches by. The WorkItem loop queues tasks beyond the free
threads (its prefetched rows): threads take the next one as soon as they
finish, without a round trip through the claim loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from django_dbworker.worker.connections import close_thread_connections

logger = logging.getLogger("django_dbworker.worker")


class Pool:
    def __init__(self, size: int, *, name: str, on_done: Callable[[], None] | None = None) -> None:
        if size < 1:
            raise ValueError("a pool needs at least one thread")
        self.size = size
        self._on_done = on_done
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._busy = 0  # submitted and not finished: queued or running
        self._running = 0
        self._cond = threading.Condition()
        self._threads = [
            threading.Thread(target=self._loop, name=f"{name}-{i + 1}", daemon=True)
            for i in range(size)
        ]
        for thread in self._threads:
            thread.start()

    def free(self) -> int:
        """Threads with nothing to do and nothing queued for them."""
        with self._cond:
            return max(0, self.size - self._busy)

    def busy(self) -> int:
        """Tasks submitted and not finished (queued or running)."""
        with self._cond:
            return self._busy

    def running(self) -> int:
        with self._cond:
            return self._running

    def queued(self) -> int:
        """Tasks waiting for a thread."""
        with self._cond:
            return self._busy - self._running

    def submit(self, fn: Callable[[], None], *, queue: bool = False) -> None:
        """Run ``fn`` on a free thread; with ``queue``, on the next thread that frees up."""
        with self._cond:
            if self._busy >= self.size and not queue:
                raise RuntimeError("no free slot in the pool")
            self._busy += 1
        self._tasks.put(fn)

    def submit_many(self, fns: list[Callable[[], None]]) -> None:
        """Queue ``fns`` for the threads, beyond the free ones if need be (a prefetch)."""
        with self._cond:
            self._busy += len(fns)
        for fn in fns:
            self._tasks.put(fn)

    def wait_idle(self, timeout: float | None = None, abort: threading.Event | None = None) -> bool:
        """Wait until no task runs; False on timeout or when ``abort`` is set."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._busy:
                if abort is not None and abort.is_set():
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                # Short waits so that ``abort`` (set on a second stop signal) is noticed.
                self._cond.wait(0.1 if remaining is None else min(0.1, remaining))
            return True

    def shutdown(self) -> None:
        """Let idle threads exit; busy ones exit after their task."""
        for _ in self._threads:
            self._tasks.put(None)

    def _loop(self) -> None:
        try:
            while True:
                fn = self._tasks.get()
                if fn is None:
                    return
                with self._cond:
                    self._running += 1
                try:
                    fn()
                except BaseException:
                    logger.exception("Unexpected error in a worker thread.")
                finally:
                    with self._cond:
                        self._busy -= 1
                        self._running -= 1
                        self._cond.notify_all()
                    if self._on_done is not None:
                        self._on_done()
        finally:
            close_thread_connections()


class InlinePool(Pool):
    """One slot, run in the submitting thread: the pool of an inline ``Worker``.

    ``testing.run_until_empty`` runs items in the caller's thread (and its
    test transaction) through the same claim loop and dispatch as the
    threaded worker.
    """

    def __init__(self) -> None:
        self.size = 1
        self._on_done = None
        self._busy = 0  # submitted and not finished: queued or running
        self._running = 0
        self._cond = threading.Condition()
        self._threads = []

    def submit(self, fn: Callable[[], None], *, queue: bool = False) -> None:
        try:
            fn()
        except BaseException:
            logger.exception("Unexpected error while running an item inline.")

    def submit_many(self, fns: list[Callable[[], None]]) -> None:
        for fn in fns:
            self.submit(fn)
