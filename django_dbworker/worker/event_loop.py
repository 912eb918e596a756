"""The worker's event loop: one thread running asyncio for async handlers' attempts.

Async handlers (``async def handle``) run here, up to ASYNC_CONCURRENCY at
once, beside the pool's threads. The loop runs handler coroutines and
nothing that waits on the database: what an attempt writes (its
``attempt_started`` hook, a failure, a retry) goes to a few threads of
its own (``offload``), and a success to the batched success writer, so
the database connections do not grow with the attempts in flight.

It also stops what should stop: every ``CANCEL_POLL`` seconds it cancels
the coroutines whose cancel was requested (the heartbeat marks the
attempt) or whose claim was lost, and a stop cancels what is left after
the drain (``cancel_all``). A thread of its own watches that the loop
answers: a handler that blocks it (a sync HTTP call, ``time.sleep``) is
logged with the stack it is blocked in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from asgiref.sync import sync_to_async

from django_dbworker.worker.attempts import Attempt
from django_dbworker.worker.config import CANCEL_GRACE
from django_dbworker.worker.connections import close_thread_connections

logger = logging.getLogger("django_dbworker.worker")

T = TypeVar("T")

#: Seconds between two looks for attempts to cancel (requests, lost claims).
CANCEL_POLL = 0.1
#: Seconds the loop may go without answering before it is reported blocked.
BLOCKED_AFTER = 0.5
#: Threads that write async attempts' outcomes other than successes.
OFFLOAD_THREADS = 2


class EventLoop:
    """A thread running an asyncio loop, the async attempts on it, and their cancels."""

    def __init__(self, size: int) -> None:
        self.size = size
        #: Made by ``start``, at the first async attempt: a worker without any has none.
        self._loop: asyncio.AbstractEventLoop
        self._offload: concurrent.futures.ThreadPoolExecutor
        self._thread = threading.Thread(target=self._run, name="dbworker-loop", daemon=True)
        self._start_lock = threading.Lock()
        self._slots: asyncio.Semaphore | None = None
        #: The attempts running here, with the task of their handler's coroutine once
        #: it started (None before); read by the cancel poll, on the loop's thread.
        self._running: dict[Attempt, asyncio.Task[Any] | None] = {}
        self._count = 0
        self._cond = threading.Condition()
        self._outer: set[asyncio.Task[Any]] = set()
        self._started = False
        self._watch_stop = threading.Event()
        #: A stop began: attempts still waiting for a slot do not start (shutdown releases them).
        self._closing = False

    # -- what the claim loop and shutdown read -------------------------------------

    def running(self) -> int:
        """Attempts submitted here and not ended."""
        with self._cond:
            return self._count

    def start(self) -> None:
        """Make the loop and start its threads, once (pool threads call it at once)."""
        with self._start_lock:
            if self._started:
                return
            self._loop = asyncio.new_event_loop()
            self._offload = concurrent.futures.ThreadPoolExecutor(
                OFFLOAD_THREADS, thread_name_prefix="dbworker-loop-db"
            )
            self._thread.start()
            threading.Thread(target=self._watch, name="dbworker-loop-watch", daemon=True).start()
            self._started = True

    def submit(self, attempt: Attempt, run: Callable[[], Awaitable[None]]) -> None:
        """Run ``run()`` for ``attempt`` on the loop, in a slot (from any thread)."""
        self.start()
        with self._cond:
            self._count += 1
        self._loop.call_soon_threadsafe(self._spawn, attempt, run)

    def _spawn(self, attempt: Attempt, run: Callable[[], Awaitable[None]]) -> None:
        task = self._loop.create_task(self._in_slot(attempt, run))
        self._outer.add(task)
        task.add_done_callback(self._outer.discard)

    async def _in_slot(self, attempt: Attempt, run: Callable[[], Awaitable[None]]) -> None:
        assert self._slots is not None
        try:
            async with self._slots:
                if self._closing:
                    return  # never started: its row is released with the leftovers
                self._running[attempt] = None
                try:
                    await run()
                finally:
                    self._running.pop(attempt, None)
        except asyncio.CancelledError:
            pass  # a stop cancelled it: its row is released by shutdown
        except BaseException:
            logger.exception("Unexpected error on the worker's event loop.")
        finally:
            with self._cond:
                self._count -= 1
                self._cond.notify_all()

    def track(self, attempt: Attempt, task: asyncio.Task[Any]) -> None:
        """``task`` runs ``attempt``'s handler: the cancel poll may cancel it."""
        if attempt in self._running:
            self._running[attempt] = task

    async def offload(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` (database work, a sync hook) on the loop's writing threads."""
        return await self._loop.run_in_executor(self._offload, lambda: fn(*args, **kwargs))

    # -- stopping ----------------------------------------------------------------------

    def stop_starting(self) -> None:
        """A stop began: what waits for a slot now will not start."""
        self._closing = True

    def wait_idle(self, timeout: float, abort: threading.Event) -> bool:
        """Wait until no attempt runs here; False at ``timeout`` or when ``abort`` is set."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._count:
                remaining = deadline - time.monotonic()
                if abort.is_set() or remaining <= 0:
                    return False
                self._cond.wait(min(0.1, remaining))
        return True

    def cancel_all(self) -> None:
        """Cancel every attempt still running (a stop past its drain) and wait for them.

        Their rows are left claimed for shutdown to release: nothing of their
        coroutines runs after that (each gets CANCEL_GRACE to end).
        """
        if not self._started:
            return
        self._loop.call_soon_threadsafe(lambda: [task.cancel() for task in list(self._outer)])
        self.wait_idle(CANCEL_GRACE + 1.0, threading.Event())

    def close(self) -> None:
        """Stop the loop and its threads (after ``cancel_all``)."""
        self._watch_stop.set()
        if not self._started:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        # Each writing thread closes its own database connections (they are per thread):
        # one call each, held at a barrier until every thread has taken one.
        barrier = threading.Barrier(OFFLOAD_THREADS)

        def close_own() -> None:
            close_thread_connections()
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(timeout=2.0)

        for _ in range(OFFLOAD_THREADS):
            self._offload.submit(close_own)
        self._offload.shutdown(wait=False)

    # -- the loop's own thread -----------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._slots = asyncio.Semaphore(self.size)
        self._loop.create_task(self._cancel_poll())
        try:
            self._loop.run_forever()
            # Stopped: what is left (the cancel poll, a coroutine that ignored its cancel)
            # is cancelled and given a moment, so that nothing is destroyed pending.
            left = asyncio.all_tasks(self._loop)
            for task in left:
                task.cancel()
            if left:
                self._loop.run_until_complete(asyncio.wait(left, timeout=1.0))
            # Handlers' sync_to_async calls ran on Django's one thread for sync code:
            # its database connections are this worker's to close too.
            closing = sync_to_async(close_thread_connections)()
            with contextlib.suppress(TimeoutError):  # that thread is busy: left as it is
                self._loop.run_until_complete(asyncio.wait_for(closing, timeout=2.0))
            self._loop.close()
        finally:
            close_thread_connections()

    async def _cancel_poll(self) -> None:
        """Cancel the coroutines of attempts whose cancel was requested or claim lost."""
        while True:
            await asyncio.sleep(CANCEL_POLL)
            for attempt, task in list(self._running.items()):
                stop = attempt.cancel_requested or attempt.lost
                if stop and task is not None and not task.done():
                    task.cancel()

    def _watch(self) -> None:
        """Report a loop that does not answer within BLOCKED_AFTER, with its stack, once a block."""
        answered = threading.Event()
        while not self._watch_stop.wait(BLOCKED_AFTER):
            answered.clear()
            started = time.monotonic()
            try:
                self._loop.call_soon_threadsafe(answered.set)
            except RuntimeError:
                return  # the loop is closed
            if answered.wait(BLOCKED_AFTER):
                continue
            frame = sys._current_frames().get(self._thread.ident or 0)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
            logger.warning(
                "The worker's event loop was blocked for more than %.1fs: an async handler "
                "called blocking code (use await, or asyncio.to_thread / sync_to_async for "
                "sync calls). The loop is running:\n%s",
                BLOCKED_AFTER,
                stack,
            )
            answered.wait()
            logger.warning(
                "The worker's event loop answered again after %.1fs.", time.monotonic() - started
            )
