"""PostgreSQL: a wake-up that announces an outranking row claims it ahead of the buffer.

The NOTIFY of an enqueue says the row's priority; a worker whose buffer is
full of lower-priority rows (far above its refill mark, so it would not
claim at all) claims the urgent row at once and starts it on its next
free thread, before the rows it buffered earlier.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from django.db import connection

from django_dbworker.models import Status, WorkItem
from django_dbworker.worker import Worker
from tests.conftest import wait_until
from tests.factories import wait_buffered_behind_gate
from tests.testapp.models import Execution
from tests.testapp.workers import GATE, Gate, RatedSlowly

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


# -- the urgent look and full rate windows -------------------------------------------------
# The urgent peek (URGENT_PEEK) claims rows that outrank the buffer, not rows it cannot take.
#
# Where wake-ups carry no priority (SQLite, MySQL/MariaDB, a pooler without WAKEUP_DATABASE),
# a buffering claim loop looks every 50 ms for a ready row outranking its lowest buffered
# priority and, if one waits, makes an urgent claim of one row past its back-pressure bound.
# A rate-limited handler whose window is full is left out of the claims until the window frees
# up (a minute for "2/m"); its ready rows must not count as outranking rows meanwhile: the
# urgent claims could never take them, so every peek would claim one more row of the buffer's
# kind, twenty claims a second, hoarding rows other workers could run.


def test_rows_of_a_full_rate_window_set_off_no_urgent_claims(
    background_worker: Callable[..., Worker], gate: None
) -> None:
    RatedSlowly.enqueue_many([{"key": f"rated-{n}"} for n in range(4)], priority=10)
    Gate.enqueue_many([{"key": f"gated-{n}", "wait": True} for n in range(1500)])
    worker = background_worker(
        ["rated_slowly", "gate"], concurrency=1, poll_interval=30.0, prefetch_horizon=5.0
    )
    wait_until(
        lambda: (
            Execution.objects.filter(kind="rated_slowly").count() == 2
            and Execution.objects.filter(key="gated-0", kind="start").exists()
        ),
        what="the window's two starts, then a gated item holding the only thread",
    )
    rated_waiting = WorkItem.objects.filter(handler="rated_slowly", status=Status.PENDING)
    wait_until(lambda: rated_waiting.count() == 2, what="the refused rated rows given back")
    loop = worker.claim_loop
    assert loop is not None
    # Every row the database shows taken has been counted by the loop (no claim's count to come).
    wait_until(
        lambda: (
            loop.claimed - loop.given_back
            == WorkItem.objects.exclude(status=Status.PENDING).count()
        ),
        what="the claim loop to have counted every claimed row",
    )
    if connection.vendor == "postgresql":
        # Its LISTEN says the priorities once its probe came back; the loop peeks until then.
        wait_until(loop.priorities_arrive, what="the listener's probe to come back")
    claimed_before = loop.claimed
    time.sleep(2.0)  # a measurement: what the loop claims in two seconds with nothing ending
    claimed = loop.claimed - claimed_before
    # Nothing ended and no row came: nothing to claim but what a refill would take.
    assert claimed <= 2, (
        f"{claimed} rows claimed in 2 s while only the full window's rows outranked the "
        f"buffer ({WorkItem.objects.filter(status=Status.CLAIMED).count()} claimed now; "
        f"wake-ups carry priorities: {loop.priorities_arrive()})"
    )
