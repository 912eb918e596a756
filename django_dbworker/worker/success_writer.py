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
from dataclasses import dataclass
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS

from django_dbworker import transitions
from django_dbworker.db.errors import is_transient
from django_dbworker.models import WorkItem
from django_dbworker.worker.connections import (
    close_thread_connections,
    guarded,
    persist,
    tidy_unless_in_transaction,
)

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
    #: Set when written; only a waiting ``record()`` has one. An Event per
    #: handed-over success (a Condition and its locks) was a tenth of the
    #: worker's GIL time in W1 (py-spy --gil, 100,000 no-op items).
    done: threading.Event | None = None
    written: Written | None = None

    @property
    def key(self) -> tuple[int, UUID]:
        return (self.item.pk, self.token)

    def finish(self) -> None:
        if self.done is not None:
            self.done.set()
        if self.callback is not None:
            assert self.written is not None
            try:
                self.callback(self.written)
            except BaseException:  # the writer thread must outlive any callback
                logger.exception("Error in a success callback.")


class SuccessWriter(threading.Thread):
    def __init__(
        self,
        using: str = DEFAULT_DB_ALIAS,
        *,
        give_up: threading.Event | None = None,
    ) -> None:
        super().__init__(name="dbworker-success-writer", daemon=True)
        self.using = using
        self.give_up = give_up
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False

    def record(self, item: WorkItem, result_json: str | None) -> bool:
        """Record ``item`` as succeeded and wait; True if it was still ours (not fenced).

        Raises the database's error if it refused the result.
        """
        done = threading.Event()
        entry = self._enqueue(item, result_json, None, done=done)
        done.wait()
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
        self,
        item: WorkItem,
        result_json: str | None,
        callback: Callback | None,
        *,
        done: threading.Event | None = None,
    ) -> _Pending:
        assert item.claim_token is not None
        entry = _Pending(item, item.claim_token, result_json, callback, done)
        with self._lock:
            direct = self._writes_here()
            if not direct:
                self._queue.put(entry)
        if direct:
            # A straggler after shutdown (an abandoned, timed-out run), or a
            # writer thread that died: write it here, alone.
            self._write([entry])
        return entry

    def _writes_here(self) -> bool:
        return self._closed or (self.ident is not None and not self.is_alive())

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
            tidy_unless_in_transaction(self.using)
            for entry in batch:
                entry.finish()

    def _settle(self, batch: list[_Pending]) -> None:
        """Write ``batch``; a batch the database refuses is retried row by row."""
        try:
            rows = [(e.item.pk, e.token, e.result_json) for e in batch]
            linked = transitions.linked_rows(e.item for e in batch)
            recorded = persist(
                lambda: guarded(
                    self.using,
                    lambda: transitions.succeed(rows, using=self.using, linked=linked),
                ),
                what="recording successes",
                give_up=self.give_up,
                using=self.using,
            )
        except Exception as exc:
            if is_transient(exc):
                raise
            if len(batch) == 1:
                batch[0].written = Refused(exc)
                return
            tidy_unless_in_transaction(self.using)
            for entry in batch:
                self._settle([entry])
            return
        missing = [e for e in batch if e.key not in recorded]
        if missing:
            recorded |= persist(
                lambda: transitions.already_succeeded([e.key for e in missing], using=self.using),
                what="checking fenced successes",
                give_up=self.give_up,
                using=self.using,
            )
        for entry in batch:
            entry.written = entry.key in recorded


class InlineSuccessWriter(SuccessWriter):
    """Writes each success in the submitting thread; no writer thread.

    ``testing.run_until_empty`` runs the worker in the caller's thread and
    transaction, where another thread's connection would not see its rows.
    """

    def _writes_here(self) -> bool:
        return True

    def start(self) -> None:
        pass
