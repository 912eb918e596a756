"""The urgent peek (URGENT_PEEK) claims rows that outrank the buffer, not rows it cannot take.

Where wake-ups carry no priority (SQLite, MySQL/MariaDB, a pooler without WAKEUP_DATABASE),
a buffering claim loop looks every 50 ms for a ready row outranking its lowest buffered
priority and, if one waits, makes an urgent claim of one row past its back-pressure bound.
A rate-limited handler whose window is full is left out of the claims until the window frees
up (a minute for "2/m"); its ready rows must not count as outranking rows meanwhile: the
urgent claims could never take them, so every peek would claim one more row of the buffer's
kind, twenty claims a second, hoarding rows other workers could run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from django.db import connection

from django_dbworker.models import Status, WorkItem
from django_dbworker.worker import Worker
from tests.conftest import wait_until
from tests.testapp.models import Execution
from tests.testapp.workers import Gate, RatedSlowly

pytestmark = pytest.mark.django_db(transaction=True)


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
