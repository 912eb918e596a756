"""Batched success records: many finished items, one fenced UPDATE, one commit.

Pool threads hand their successes to one writer thread and go on to the
next item (the attempt stays in the worker's in-flight set, heartbeated,
until its callback reports the write). Whatever arrives while a write is in
flight goes into the next write, so batches form by themselves under load
and a lone success is written at once (group commit: no timer, no added
latency). Each row in a batch is still fenced by its own claim token.

Every entry is settled: recorded, fenced out, refused by the database (one
value the database will not store fails the whole statement, so the batch
is retried row by row and only the refused row is reported as such), or,
when the worker stops at once while the database is away, the error. If
the writer thread is gone, entries are written by the thread that submits
them, so a success is never queued where nobody will write it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from uuid import UUID

from django_dbworker.db import VendorOperations
from django_dbworker.db.errors import is_transient
from django_dbworker.models import Status, WorkItem
from django_dbworker.worker.connections import close_thread_connections, persist, tidy

logger = logging.getLogger("django_dbworker.worker")

#: Most rows per UPDATE.
MAX_BATCH = 200


@dataclass(frozen=True)
class Refused:
    """The database refused to store this result; ``error`` says why."""

    error: BaseException


#: How a write went: True recorded, False fenced out, ``Refused``, or the
#: error that made the writer give up (the row is still claimed).
Written = bool | Refused | BaseException
Callback = Callable[[Written], None]


@dataclass(eq=False)
class _Pending:
    item: WorkItem
    token: UUID
    result_json: str | None
    callback: Callback | None = None
    done: threading.Event = field(default_factory=threading.Event)
    written: Written | None = None

    @property
    def key(self) -> tuple[int, UUID]:
        return (self.item.pk, self.token)

    def finish(self) -> None:
        self.done.set()
        if self.callback is not None:
            assert self.written is not None
            try:
                self.callback(self.written)
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
        """Record ``item`` as succeeded and wait; True if it was still ours (not fenced).

        Raises the database's error if it refused the result.
        """
        entry = self._enqueue(item, result_json, None)
        entry.done.wait()
        written = entry.written
        if isinstance(written, Refused):
            raise written.error
        if isinstance(written, BaseException):
            raise written
        return bool(written)

    def submit(self, item: WorkItem, result_json: str | None, callback: Callback) -> None:
        """Record ``item`` as succeeded without waiting; ``callback`` hears how it went."""
        self._enqueue(item, result_json, callback)

    def _enqueue(
        self, item: WorkItem, result_json: str | None, callback: Callback | None
    ) -> _Pending:
        assert item.claim_token is not None
        entry = _Pending(item, item.claim_token, result_json, callback)
        with self._lock:
            direct = self._closed or (self.ident is not None and not self.is_alive())
            if not direct:
                self._queue.put(entry)
        if direct:
            # A straggler after shutdown (an abandoned, timed-out run), or a
            # writer thread that died: write it here, alone.
            self._write([entry])
        return entry

    def close(self) -> None:
        """Write what is queued, then stop (or write it here if the thread is gone)."""
        with self._lock:
            self._queue.put(None)
            dead = self.ident is not None and not self.is_alive()
            if dead:
                self._closed = True
        if dead:
            self._write(self._drain([]))

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
            self._settle(batch)
        except BaseException as exc:  # gave up, or a bug: the submitters must hear of it
            for entry in batch:
                if entry.written is None:
                    entry.written = exc
        finally:
            tidy(self.ops.using)
            for entry in batch:
                entry.finish()

    def _settle(self, batch: list[_Pending]) -> None:
        """Write ``batch``; a batch the database refuses is retried row by row."""
        try:
            recorded = persist(
                lambda: self.ops.succeed_many([(e.item.pk, e.token, e.result_json) for e in batch]),
                what="recording successes",
                give_up=self.give_up,
                using=self.ops.using,
            )
        except Exception as exc:
            if is_transient(exc):
                raise
            if len(batch) == 1:
                batch[0].written = Refused(exc)
                return
            tidy(self.ops.using)
            for entry in batch:
                self._settle([entry])
            return
        missing = [e for e in batch if e.key not in recorded]
        if missing:
            recorded |= persist(
                lambda: self._already_recorded(missing),
                what="checking fenced successes",
                give_up=self.give_up,
                using=self.ops.using,
            )
        for entry in batch:
            entry.written = entry.key in recorded

    def _already_recorded(self, entries: list[_Pending]) -> set[tuple[int, UUID]]:
        """Attempts our own earlier try of this write already recorded.

        When a write's connection dies after the commit but before the answer,
        ``persist`` writes again and those rows no longer match ``claimed``.
        ``succeeded`` under our own token tells them apart from fenced rows.
        """
        rows = WorkItem.objects.using(self.ops.using).filter(
            pk__in=[e.item.pk for e in entries],
            claim_token__in=[e.token for e in entries],
            status=Status.SUCCEEDED,
        )
        return {e.key for e in entries} & set(rows.values_list("pk", "claim_token"))
