"""One thread per process that heartbeats every in-flight row in one UPDATE."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from uuid import UUID

from django_dbworker import transitions
from django_dbworker.worker.connections import (
    TRANSIENT_ERRORS,
    close_quietly,
    close_thread_connections,
)

logger = logging.getLogger("django_dbworker.worker")


class Heartbeat(threading.Thread):
    """Keeps claims alive; tells the owner which claims were lost.

    ``snapshot`` returns ``{id: claim_token}`` of the rows to keep alive;
    ``on_lost`` receives the ids whose token is gone (recovered as stale and
    possibly re-claimed elsewhere), which are then no longer heartbeated.
    """

    def __init__(
        self,
        *,
        interval: float,
        snapshot: Callable[[], Mapping[int, UUID]],
        on_lost: Callable[[set[int]], None],
        using: str,
    ) -> None:
        super().__init__(name="dbworker-heartbeat", daemon=True)
        self.interval = interval
        self.snapshot = snapshot
        self.on_lost = on_lost
        self.using = using
        self.stopped = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopped.wait(self.interval):
                self.beat()
        finally:
            close_thread_connections()

    def beat(self) -> None:
        claims = dict(self.snapshot())
        if not claims:
            return
        try:
            held = transitions.heartbeat(claims, using=self.using)
        except TRANSIENT_ERRORS as exc:
            logger.warning("Heartbeat failed (%s); retrying in %.1fs.", exc, self.interval)
            close_quietly(self.using)
            return
        lost = set(claims) - held
        if lost:
            self.on_lost(lost)

    def stop(self) -> None:
        self.stopped.set()
