"""The polling loop of one own-table ``Handler[T]``: the Go kit's loop, made safe.

Each cycle calls ``recover_stale``, then ``claim``s while slots are free,
handing each item to a bounded pool that runs ``process``. Any exception
(``BaseException`` included) from user code is logged and counted, never
kills the loop and never leaks a slot.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from django_dbworker.errors import NoTask
from django_dbworker.handlers import Handler
from django_dbworker.worker.connections import close_thread_connections, tidy
from django_dbworker.worker.pool import Pool

logger = logging.getLogger("django_dbworker.worker")


class HandlerLoop(threading.Thread):
    def __init__(
        self,
        handler: Handler[Any],
        *,
        stopping: threading.Event,
        burst: bool,
        using: str,
    ) -> None:
        super().__init__(name=f"dbworker-loop-{handler.name}", daemon=True)
        self.handler = handler
        self.stopping = stopping
        self.burst = burst
        self.using = using
        self.slot_freed = threading.Event()
        self.pool = Pool(
            max(1, int(handler.max_concurrency)),
            name=f"dbworker-{handler.name}",
            on_done=self.slot_freed.set,
        )
        self.claim_errors = 0
        self.cycles = 0

    def run(self) -> None:
        try:
            self._loop()
        finally:
            self.pool.shutdown()
            close_thread_connections()

    def _loop(self) -> None:
        handler = self.handler
        while not self.stopping.is_set():
            self.cycles += 1
            self._call("recover_stale", handler.recover_stale)
            exhausted = False
            while not self.stopping.is_set() and self.pool.free() > 0:
                self.slot_freed.clear()
                try:
                    item = handler.claim()
                except NoTask:
                    exhausted = True
                    break
                except BaseException:
                    self.claim_errors += 1
                    logger.exception("claim() of handler %s raised.", handler.name)
                    exhausted = True
                    break
                finally:
                    tidy(self.using)
                self.pool.submit(self._processor(item))
            if self.burst and exhausted:
                # Finish what is running, then look once more: processing
                # may have made more work claimable.
                self.pool.wait_idle(abort=self.stopping)
                try:
                    item = handler.claim()
                except NoTask:
                    return
                except BaseException:
                    self.claim_errors += 1
                    logger.exception("claim() of handler %s raised.", handler.name)
                    return
                finally:
                    tidy(self.using)
                self.pool.submit(self._processor(item))
                continue
            if exhausted:
                self.stopping.wait(float(handler.interval))
            else:
                # All slots busy: wait for one to free up (or stop).
                while not self.stopping.is_set() and not self.slot_freed.wait(0.5):
                    pass

    def _processor(self, item: Any) -> Any:
        def run() -> None:
            self._call("process", lambda: self.handler.process(item))

        return run

    def _call(self, what: str, fn: Any) -> None:
        try:
            fn()
        except BaseException:
            logger.exception("%s() of handler %s raised.", what, self.handler.name)
        finally:
            tidy(self.using)

    def drain(self, timeout: float, abort: threading.Event) -> bool:
        return self.pool.wait_idle(timeout, abort=abort)
