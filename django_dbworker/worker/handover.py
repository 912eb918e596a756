"""The worker's side of the slot hand-over (``db/handover.py`` says what and why).

The success writer asks, before a write of rows of limited handlers, what it
may claim for this worker (``terms``), and hands the rows its write claimed
to ``take``, which puts them in flight like a claim's rows. Both run on the
success writer's thread.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from django_dbworker.db.handover import HandOver
from django_dbworker.handlers import WorkItemHandler
from django_dbworker.models import WorkItem
from django_dbworker.worker.attempts import Attempt
from django_dbworker.worker.claim_loop import ClaimLoop
from django_dbworker.worker.identity import worker_id

logger = logging.getLogger("django_dbworker.worker")


class SlotHandOver:
    def __init__(self, loop: ClaimLoop) -> None:
        self.loop = loop
        #: Rows the success writer claimed in the slots it freed.
        self.handed_over = 0
        self._seen: Mapping[str, WorkItemHandler] | None = None
        self._seen_limits: dict[str, int] = {}

    def hand_over_terms(self) -> HandOver | None:
        """What a success write may claim for this worker now; None: nothing.

        The limited handlers this worker claims for (a rate-limited one is
        claimed only in its window's claims), its queues, and a budget of what
        its next claim could take (``ClaimLoop.room_now``: threads and the
        buffer target), so the hand-over buffers no more than a claim would.
        """
        loop = self.loop
        control, config = loop.control, loop.config
        if control.stopping.is_set() or control.draining.is_set() or config.inline:
            return None
        limits = self._limits(loop.handlers())
        if not limits:
            return None
        budget = loop.room_now()
        if config.max_items is not None:
            budget = min(budget, config.max_items - loop.claimed)
        if budget <= 0:
            return None
        return HandOver(limits=limits, queues=config.queues, worker=worker_id(), budget=budget)

    def _limits(self, handlers: Mapping[str, WorkItemHandler]) -> dict[str, int]:
        """The limited, not rate-limited handlers' current limits, once per mapping
        (replaced, never changed in place, when handlers are added)."""
        if handlers is not self._seen:
            self._seen_limits = {
                name: limit
                for name, handler in handlers.items()
                if (limit := handler.concurrency_limit) is not None
                and getattr(handler, "rate_limit", None) is None
            }
            self._seen = handlers
        return self._seen_limits

    def take_handed_over(self, items: Sequence[WorkItem]) -> None:
        """Rows a success write claimed for this worker: in flight from here on.

        Claimed as the worker began to stop, they go back to pending at once
        (or, if that fails, into the ledger, whose leftovers the stop releases).
        """
        loop = self.loop
        loop.count_claimed(len(items))
        self.handed_over += len(items)
        if not loop.control.stopping.is_set():
            loop.dispatch(items, claimed_at=loop.clock.now())
            return
        handlers = loop.handlers()
        attempts = [
            Attempt(item, handlers[item.handler], claimed_at=loop.clock.now()) for item in items
        ]
        try:
            loop.shutdown.release(attempts, "releasing handed-over work items")
        except Exception as exc:
            logger.warning("Could not release %d handed-over work item(s): %s", len(items), exc)
            loop.ledger.add(attempts)
