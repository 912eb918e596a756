"""Batched success records: many finished items, one fenced UPDATE, one commit.

Pool threads hand their successes to one writer thread and go on to the
next item (the row stays in the worker's in-flight set, heartbeated, until
its callback reports the write). Whatever arrives while a write is in flight goes into the next
write, so batches form by themselves under load and a lone success is
written at once (group commit: no timer, no added latency). Each row in a
batch is still fenced by its own claim token.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from uuid import UUID

from django_dbworker.db import VendorOperations
from django_dbworker.models import Status, WorkItem
from django_dbworker.worker.connections import close_thread_connections, persist, tidy

logger = logging.getLogger("django_dbworker.worker")

#: Most rows per UPDATE.
MAX_BATCH = 200


#: Told the outcome of a write: True recorded, False fenced out, or the error.
Callback = Callable[[bool | BaseException], None]


@dataclass
class _Pending:
    pk: int
    token: UUID
    result_json: str | None
    callback: Callback | None = None
    done: threading.Event = field(default_factory=threading.Event)
    recorded: bool = False
    error: BaseException | None = None

    def finish(self) -> None:
        self.done.set()
        if self.callback is not None:
            try:
                self.callback(self.error if self.error is not None else self.recorded)
            except Exception:
                logger.exception("Error in a success callback.")


class SuccessWriter(threading.Thread):
    def __init__(self, ops: VendorOperations, *, give_up: threading.Event | None = None) -> None:
        super().__init__(name="dbworker-outcomes", daemon=True)
        self.ops = ops
        self.give_up = give_up
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False

    def record(self, item: WorkItem, result_json: str | None) -> bool:
        """Record ``item`` as succeeded and wait; True if it was still ours (not fenced)."""
        entry = self._enqueue(item, result_json, None)
        entry.done.wait()
        if entry.error is not None:
            raise entry.error
        return entry.recorded

    def submit(self, item: WorkItem, result_json: str | None, callback: Callback) -> None:
        """Record ``item`` as succeeded without waiting; ``callback`` hears how it went."""
        self._enqueue(item, result_json, callback)

    def _enqueue(
        self, item: WorkItem, result_json: str | None, callback: Callback | None
    ) -> _Pending:
        assert item.claim_token is not None
        entry = _Pending(item.pk, item.claim_token, result_json, callback)
        with self._lock:
            closed = self._closed
            if not closed:
                self._queue.put(entry)
        if closed:
            # A straggler after shutdown (an abandoned, timed-out run): write it alone.
            self._write([entry])
        return entry

    def close(self) -> None:
        """Write what is queued, then stop."""
        self._queue.put(None)

    def run(self) -> None:
        try:
            while True:
                first = self._queue.get()
                if first is None:
                    with self._lock:
                        self._closed = True
                    self._write(self._drain([]))
                    return
                batch = [first]
                stop = False
                while len(batch) < MAX_BATCH:
                    try:
                        entry = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if entry is None:
                        stop = True
                        break
                    batch.append(entry)
                self._write(batch)
                if stop:
                    with self._lock:
                        self._closed = True
                    self._write(self._drain([]))
                    return
        finally:
            close_thread_connections()

    def _drain(self, batch: list[_Pending]) -> list[_Pending]:
        while True:
            try:
                entry = self._queue.get_nowait()
            except queue.Empty:
                return batch
            if entry is not None:
                batch.append(entry)

    def _write(self, batch: list[_Pending]) -> None:
        if not batch:
            return
        try:
            rows = [(e.pk, e.token, e.result_json) for e in batch]
            recorded = persist(
                lambda: self.ops.succeed_many(rows),
                what="recording successes",
                give_up=self.give_up,
                using=self.ops.using,
            )
            missing = [e for e in batch if e.pk not in recorded]
            if missing:
                recorded |= self._already_recorded(missing)
            for entry in batch:
                entry.recorded = entry.pk in recorded
        except BaseException as exc:  # the waiting pool threads must hear of it
            for entry in batch:
                entry.error = exc
        finally:
            tidy(self.ops.using)
            for entry in batch:
                entry.finish()

    def _already_recorded(self, entries: list[_Pending]) -> set[int]:
        """Rows our own earlier attempt of this write already recorded.

        When a write's connection dies after the commit but before the answer,
        ``persist`` writes again and those rows no longer match ``claimed``.
        ``succeeded`` under our own token tells them apart from fenced rows.
        """
        return set(
            WorkItem.objects.using(self.ops.using)
            .filter(
                pk__in=[e.pk for e in entries],
                claim_token__in=[e.token for e in entries],
                status=Status.SUCCEEDED,
            )
            .values_list("pk", flat=True)
        )
