"""The ledger's cancel mark is per attempt (row id + claim token), never per row."""

from __future__ import annotations

import uuid

from django_dbworker.handlers import WorkItemHandler, cancel_was_requested, running_attempt
from django_dbworker.models import WorkItem
from django_dbworker.registry import registry
from django_dbworker.worker.attempts import Attempt, Ledger


def _attempt(pk: int, handler: WorkItemHandler) -> Attempt:
    item = WorkItem(pk=pk, handler=handler.name, claim_token=uuid.uuid4(), priority=0)
    return Attempt(item=item, handler=handler, claimed_at=0.0)


def test_the_mark_follows_the_attempt_not_the_row() -> None:
    handler = registry["noop"]()
    assert isinstance(handler, WorkItemHandler)
    ledger = Ledger()
    first, other = _attempt(1, handler), _attempt(2, handler)
    ledger.add([first, other])
    ledger.mark_cancel_requested({(1, uuid.uuid4())})  # another attempt of row 1
    assert not first.cancel_requested
    ledger.mark_cancel_requested({first.key})
    assert first.cancel_requested and not other.cancel_requested
    assert cancel_was_requested(first.item) and not cancel_was_requested(other.item)


def test_cancel_requested_reads_the_attempt_of_the_calling_thread() -> None:
    handler = registry["noop"]()
    assert isinstance(handler, WorkItemHandler)
    asked, calm = _attempt(1, handler), _attempt(2, handler)
    asked.cancel_requested = True
    assert handler.cancel_requested is False  # no attempt: handle() called directly
    with running_attempt(asked.item):
        assert handler.cancel_requested is True
        with running_attempt(calm.item):
            assert handler.cancel_requested is False
        assert handler.cancel_requested is True
    assert handler.cancel_requested is False
