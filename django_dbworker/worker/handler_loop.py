"""The polling loop of one own-table ``Handler[T]``: the Go kit's loop, made safe.

Each cycle calls ``recover_stale``, then ``claim``s while slots are free,
handing each item to a bounded pool that runs ``process``. Any exception
(``BaseException`` included) from user code is logged and counted, never
kills the loop and never leaks a slot.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from django_dbworker.errors import NoTask
from django_dbworker.handlers import Handler
from django_dbworker.metrics import WorkerMetrics, default_metrics
from django_dbworker.outcomes import Outcome
from django_dbworker.worker.connections import (
    close_thread_connections,
    refresh_all_if_idle,
    tidy_all,
)
from django_dbworker.worker.pool import Pool

logger = logging.getLogger("django_dbworker.worker")

#: What ``_claim`` returns when there is nothing to process.
_NOTHING = object()


class HandlerLoop(threading.Thread):
    def __init__(
        self,
        handler: Handler[Any],
        *,
        stopping: threading.Event,
        burst: bool,
        using: str,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        super().__init__(name=f"dbworker-loop-{handler.name}", daemon=True)
        self.handler = handler
        self.metrics = metrics or default_metrics()
        self.stopping = stopping
        self.burst = burst
        self.using = using
        self.slot_freed = threading.Event()
        self.pool = Pool(
            max(1, int(handler.max_concurrency)),
            name=f"dbworker-{handler.name}",
            on_done=self.slot_freed.set,
        )

    def run(self) -> None:
        try:
            self._loop()
        finally:
            self.pool.shutdown()
            close_thread_connections()

    def _loop(self) -> None:
        while not self.stopping.is_set():
            self.metrics.poll(self.handler.name)
            self._recover()
            exhausted = self._fill()
            if self.burst and exhausted:
                # Finish what is running, then look once more: processing
                # may have made more work claimable.
                self.pool.wait_idle(abort=self.stopping)
                item = self._claim()
                if item is _NOTHING:
                    return
                self.pool.submit(self._processor(item))
                continue
            if exhausted:
                self.stopping.wait(float(self.handler.interval))
            else:
                # All slots busy: wait for one to free up (or stop).
                while not self.stopping.is_set() and not self.slot_freed.wait(0.5):
                    pass

    def _fill(self) -> bool:
        """Claim while slots are free; True when claim() found nothing (or failed)."""
        while not self.stopping.is_set() and self.pool.free() > 0:
            self.slot_freed.clear()
            item = self._claim()
            if item is _NOTHING:
                return True
            self.pool.submit(self._processor(item))
        return False

    def _claim(self) -> Any:
        """One ``claim()``: the item, or ``_NOTHING`` on NoTask or any error."""
        name = self.handler.name
        started = time.perf_counter()
        refresh_all_if_idle(self.using)
        try:
            return self.handler.claim()
        except NoTask:
            return _NOTHING
        except BaseException:  # user code may raise anything
            self.metrics.claim_error(name)
            logger.exception("claim() of handler %s raised.", name)
            return _NOTHING
        finally:
            self.metrics.claim_took(name, time.perf_counter() - started)
            tidy_all(self.using)

    def _recover(self) -> None:
        started = time.perf_counter()
        self._call("recover_stale", self.handler.recover_stale)
        self.metrics.recover_took(self.handler.name, time.perf_counter() - started)

    def _processor(self, item: Any) -> Any:
        name = self.handler.name

        def run() -> None:
            refresh_all_if_idle(self.using)
            started = time.perf_counter()
            with self.metrics.running(name):
                ok = self._call("process", lambda: self.handler.process(item))
            status = Outcome.SUCCEEDED if ok else Outcome.FAILED
            self.metrics.task_done(name, status, time.perf_counter() - started)

        return run

    def _call(self, what: str, fn: Any) -> bool:
        """Run user code; log anything it raises. Returns whether it returned normally."""
        try:
            fn()
            return True
        except BaseException:  # user code may raise anything
            logger.exception("%s() of handler %s raised.", what, self.handler.name)
            return False
        finally:
            tidy_all(self.using)

    def drain(self, timeout: float, abort: threading.Event) -> bool:
        return self.pool.wait_idle(timeout, abort=abort)
