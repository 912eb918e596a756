"""The hand-over: a success write passes its key's slot on to the key's next row.

With ``concurrency_limit = 1`` a key moves one row per chain of claim, run and success
write. Before, the next link waited for a claim loop that kept claiming to catch the
freed slot; a keyed claim that finds every key busy costs about as much as one that takes
them all, and W7 (100 keys, 2 processes) measured half its claims empty, 5 to 12 ms each
(docs/internals/benchmarks.md). Here the success writer's statement records the batch
and claims the next ready row of each key whose row it ended (``succeed_and_transfer``:
no key lock, no second count, since it hands each slot from one row to the next; keys of
limit 1 only, see ``_limited``) and, after the commit, those rows join this worker's
buffer as a claim's rows do. Meanwhile the
claim loop rests (``ClaimLoop.rests``): a low buffer does not wake it; a key freed and not
handed over does (``key_freed``), as do new rows and the poll.

Only while the loop rests: its last claim took every row it could, so a freed key's next
row is what the next claim would take for that slot, not a row that jumps ahead of other
claimable rows (a worker whose claims come back full hands nothing over, and its keys
move in claim order as before). Only up to the room a claim would fill (free threads and
prefetch), never while stopping, never for rate-limited handlers (their starts are
counted by their own claim), and only on a vendor that has the statement (PostgreSQL).
If the statement fails for a reason other than the connection, the success write is
repeated without it, and if that one is not refused too, hand-overs stop for this
process: a success is never refused for the sake of a hand-over.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING
from uuid import UUID

from django_dbworker import transitions
from django_dbworker.db import VendorOperations
from django_dbworker.db.errors import is_transient
from django_dbworker.handlers import WorkItemHandler
from django_dbworker.models import WorkItem
from django_dbworker.transitions import Recorded
from django_dbworker.worker.attempts import Attempt
from django_dbworker.worker.identity import worker_id
from django_dbworker.worker.peers import KeyShare

if TYPE_CHECKING:  # the claim loop imports the writer, which imports this
    from django_dbworker.worker.claim_loop import ClaimLoop
    from django_dbworker.worker.success_writer import SuccessWriter

logger = logging.getLogger("django_dbworker.worker")

Key = tuple[str, str]


class TransferFailed(Exception):
    """The hand-over's statement failed other than by the connection (its cause says why)."""


class Transfer:
    """One success batch's hand-over: its write, then, after the commit, its delivery."""

    def __init__(
        self,
        *,
        owner: KeyHandOver,
        keys: Mapping[int, Key],
        room: int,
    ) -> None:
        self.owner = owner
        #: Row id -> the (handler, concurrency_key) whose slot its success frees.
        self.keys = keys
        self.room = room
        #: What the last write claimed and which of the rows it recorded; how many writes.
        self.taken: list[WorkItem] = []
        self.recorded: list[int] = []
        self.writes = 0
        #: The ended rows' queues where the key share cut the room (the keys left over
        #: are for the other workers, woken after the commit); else empty.
        self.queues: set[str] = set()

    def __call__(self, outcomes: Sequence[tuple[int, UUID, str | None]]) -> list[Recorded]:
        """The batch's success write (``transitions.succeed``'s ``write``), which claims the
        next rows of the keys it frees, in the name of this (the writer's) thread.

        Repeated if the write is retried, and only the last answer counts. A retry after a
        connection lost at the commit may find the batch recorded and its keys' rows
        claimed by the write before: it asks for those too (``adopt``), and ``deliver``
        takes the ones this worker does not hold, which nobody else would run.
        """
        self.writes += 1
        try:
            recorded, self.taken = self.owner.ops.succeed_and_transfer(
                outcomes,
                limit=self.room,
                queues=self.owner.claim_loop.config.queues,
                worker=worker_id(),
                limits=dict.fromkeys({handler for handler, _ in self.keys.values()}, 1),
                adopt=self.writes > 1,
            )
        except Exception as exc:
            if is_transient(exc):
                raise  # the write is retried, this with it
            raise TransferFailed(str(exc)) from exc
        self.recorded = [pk for pk, _, _ in recorded if pk in self.keys]
        return recorded

    def deliver(self) -> None:
        """After the commit: the claimed rows join the buffer; keys left free wake the loop."""
        loop = self.owner.claim_loop
        self.owner.dealt(self.recorded)
        taken = self.taken
        if self.writes > 1:  # rows a lost answer claimed for this worker, or held already
            held = {item.pk for item in loop.ledger.items()}
            taken = [item for item in taken if item.pk not in held]
        if taken:
            self.owner.handed_over += len(taken)
            refused = loop.take(taken)
            if refused:  # committed after a stop took the leftovers: nobody else releases these
                self.owner.release_late(refused)
        if len(self.taken) < len({self.keys[pk] for pk in self.recorded}):
            # A freed key without a next row costs the loop one claim that finds nothing;
            # one whose row the room left behind is claimed by that claim, or, where the
            # key share cut the room, by another worker's.
            loop.key_freed()
            if self.queues and len(self.taken) >= self.room:  # the share left keys over
                self.owner.share_out(self.queues)


def retired(
    attempt: Attempt,
    loop: ClaimLoop | None,
    handover: KeyHandOver | None,
    otherwise: Callable[[], None],
) -> None:
    """An attempt left the ledger (``Ledger``'s ``on_retired``): if it held a limited key's
    slot that no transfer passed on, the claim loop claims now (``key_freed``); else
    ``otherwise`` (the loop wakes if its buffer is low)."""
    if (
        loop is not None
        and attempt.item.concurrency_key is not None
        and attempt.handler.concurrency_limit is not None
        and not (handover is not None and handover.quiet(attempt))
    ):
        loop.key_freed()
    else:
        otherwise()


class KeyHandOver:
    """Prepares the success writer's transfers (``SuccessWriter.handover``)."""

    @classmethod
    def attach(
        cls, loop: ClaimLoop, writer: SuccessWriter, ops: VendorOperations
    ) -> KeyHandOver | None:
        """The hand-over of a threaded worker's writer, where the vendor has the statement."""
        if not ops.supports_key_handover:
            return None
        writer.handover = handover = cls(claim_loop=loop, ops=ops, handlers=loop.handlers)
        # A key stays where it is handed over: the workers share them (``peers.py``).
        loop.key_share = KeyShare.of(
            loop.config,
            handlers=loop.handlers,
            clock=loop.clock,
            bounded=getattr(ops, "register_transaction", None),
        )
        return handover

    @property
    def share(self) -> KeyShare:
        """This worker's share of the keys, and its row in the register of workers."""
        assert self.claim_loop.key_share is not None  # set by ``attach``
        return self.claim_loop.key_share

    @property
    def listens(self) -> bool:
        """Whether a burst worker listens for wake-ups too: one with limited handlers, whose
        keys a peer leaves it would otherwise wait for its next poll."""
        return self.share.limited()

    def __init__(
        self,
        *,
        claim_loop: ClaimLoop,
        ops: VendorOperations,
        handlers: Callable[[], Mapping[str, WorkItemHandler]],
    ) -> None:
        self.claim_loop = claim_loop
        self.ops = ops
        self.handlers = handlers
        #: Rows whose freed key a committed transfer dealt with (handed over, or the loop
        #: woken): their retirement wakes nothing more.
        self._dealt: set[int] = set()
        self._lock = threading.Lock()
        #: Set when a transfer failed other than by the connection: no more of them here.
        self.broken = False
        #: Rows claimed by transfers, for the record.
        self.handed_over = 0
        self._seen: Mapping[str, WorkItemHandler] | None = None
        self._limited_names: frozenset[str] = frozenset()

    def prepare(self, items: Sequence[WorkItem]) -> Transfer | None:
        """The transfer for a batch of successes about to be written, or None."""
        limited = self._limited()
        if not limited or self.broken:
            return None
        keys = {
            item.pk: (item.handler, item.concurrency_key)
            for item in items
            if item.concurrency_key is not None and item.handler in limited
        }
        if not keys or transitions.linked_rows(items):  # linked: written as before
            return None
        room, shared = self.claim_loop.handover_room(len(keys))
        if room <= 0 and not shared:
            return None
        # Cut by the key share, even to nothing: the transfer's delivery, after the
        # commit, wakes the other workers for the keys it leaves (``share_out``).
        transfer = Transfer(owner=self, keys=keys, room=room)
        if shared:
            transfer.queues = {item.queue for item in items}
        return transfer

    def share_out(self, queues: Collection[str]) -> None:
        """Wake the other workers of ``queues`` (after a commit that freed keys this worker
        does not take again, its key share): those keys wait for their claims (``peers.py``)."""
        try:
            self.ops.notify(sorted(queues))
        except Exception as exc:
            logger.debug("Could not wake the other workers for freed keys: %s", exc)

    def _limited(self) -> frozenset[str]:
        """The handlers whose keys are handed over: those of limit 1, but not the
        rate-limited (their starts are counted by their own claim).

        Limit 1 only: the statement counts the key's slots in its snapshot, taken before it
        may wait for its rows' locks (a heartbeat holds them a moment). While the ended row
        holds a key's only slot no one else can claim a row of that key, so the count
        cannot be stale; with a limit of 2 another worker took the other slot during such a
        wait and the key had 3 rows claimed (``test_attack_s12_handover.py``).
        """
        handlers = self.handlers()
        if handlers is not self._seen:  # replaced, never changed, when handlers are added
            rated = self.claim_loop.rate_holds.rates(handlers)
            self._limited_names = frozenset(
                name
                for name, handler in handlers.items()
                if handler.concurrency_limit == 1 and name not in rated
            )
            self._seen = handlers
        return self._limited_names

    def failed(self, transfer: Transfer, exc: BaseException) -> None:
        """A write with ``transfer`` failed where the write without it did not: stop."""
        self.broken = True
        logger.error(
            "Handing freed concurrency keys over failed (%s); this worker claims them instead.",
            exc,
            exc_info=exc,
        )
        self.claim_loop.key_freed()

    def release_late(self, refused: Sequence[Attempt]) -> None:
        """Hand back rows a transfer claimed after the worker's stop released its leftovers;
        if that fails too, stale recovery returns them (they are heartbeated by nobody)."""
        try:
            released = self.claim_loop.shutdown.release(refused, "releasing rows handed over late")
        except Exception as exc:
            logger.warning("Could not release %d row(s) handed over late: %s", len(refused), exc)
            return
        logger.info("Released %d row(s) handed over after the stop began.", released)

    def dealt(self, rows: Collection[int]) -> None:
        """A committed transfer dealt with these rows' freed keys (``quiet``)."""
        with self._lock:
            self._dealt.update(rows)

    def quiet(self, attempt: Attempt) -> bool:
        """Whether ``attempt``'s freed key was dealt with by a transfer (once; forgets it)."""
        with self._lock:
            if attempt.item.pk in self._dealt:
                self._dealt.discard(attempt.item.pk)
                return True
        return False
