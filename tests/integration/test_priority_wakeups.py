"""PostgreSQL: a wake-up that announces an outranking row claims it ahead of the buffer.

The NOTIFY of an enqueue says the row's priority; a worker whose buffer is
full of lower-priority rows (far above its refill mark, so it would not
claim at all) claims the urgent row at once and starts it on its next
free thread, before the rows it buffered earlier.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from django_dbworker.models import Status, WorkItem
from django_dbworker.worker import Worker
from tests.conftest import wait_until
from tests.factories import wait_buffered_behind_gate
from tests.testapp.models import Execution
from tests.testapp.workers import GATE, Gate

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]


def test_an_urgent_wake_up_claims_ahead_of_a_full_buffer_and_starts_next(
    background_worker: Callable[..., Worker], gate: None
) -> None:
    # Fast items first: the worker learns the pace and buffers behind the
    # gated item that then holds its only thread.
    Gate.enqueue_many([{"key": f"fast-{n}"} for n in range(5)], priority=10)
    # Once the gated item has held the thread for a while, the buffer's
    # target (what the thread can start within the horizon) falls to a few
    # rows: the buffer stays far above its refill mark, and no ordinary
    # claim comes while the gate is shut.
    Gate.enqueue_many([{"key": f"gated-{n}", "wait": True} for n in range(300)])
    worker = background_worker(["gate"], concurrency=1, poll_interval=30.0, prefetch_horizon=5.0)
    # Every row the database shows taken has been counted by the claim loop:
    # no claim's count is still to come.
    wait_buffered_behind_gate(worker)
    claims_before = worker.claims
    urgent = Gate.enqueue({"key": "urgent"}, priority=5)
    # Nothing drains the buffer (the gate is shut): only the wake-up can claim it.
    wait_until(
        lambda: WorkItem.objects.get(pk=urgent.pk).status == Status.CLAIMED,
        timeout=10,
        what="the urgent row to be claimed ahead of the buffer",
    )
    # A claim of its own, not a refill that happened to take it: no other row
    # has its claim time (one claim statement stamps all its rows alike). An
    # urgent claim that comes back full may be followed by a bigger one (one
    # wake-up can stand for a batch), which takes rows still pending behind
    # the buffer when the machine is slow: that one is allowed.
    urgent.refresh_from_db()
    assert urgent.claimed_at is not None
    assert not WorkItem.objects.filter(claimed_at=urgent.claimed_at).exclude(pk=urgent.pk).exists()
    wait_until(lambda: worker.claims > claims_before, what="the claim to be counted")
    GATE.set()
    wait_until(
        lambda: Execution.objects.filter(key="urgent", kind="start").exists(),
        timeout=20,
        what="the urgent item to start",
    )
    starts = list(
        Execution.objects.filter(kind="start", key__startswith="gated")
        .values_list("key", flat=True)
        .order_by("pk")
    )
    urgent_start = Execution.objects.get(key="urgent", kind="start").pk
    started_before = Execution.objects.filter(
        kind="start", key__startswith="gated", pk__lt=urgent_start
    ).count()
    assert started_before == 1, f"buffered rows started before the urgent one: {starts}"
