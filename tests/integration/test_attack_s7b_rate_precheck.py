"""Attack s7b: 95cad88's "nothing ready" read before a rate-limited claim (holds).

The read (``WorkItem.objects.ready().filter(handler=...)``, Django's ``Now()``)
must never miss a row the claim statement (its vendor's clock) would take:
rows enqueued in the caller's own transaction (run_until_empty in a test), due
just now, and the window's housekeeping must still run once rows come back.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import transaction
from django.db.models.functions import Now

from django_dbworker import pause_queue
from django_dbworker.flow.models import RateStart
from django_dbworker.models import WorkItem
from django_dbworker.testing import run_until_empty
from tests.factories import claim_rated
from tests.testapp.workers import Rated, RatedSlowly

pytestmark = pytest.mark.django_db(transaction=True)


def _claim(limit: int = 4) -> object:
    return claim_rated(
        handler="rated_slowly", starts=2, period=60.0, limit=limit, queues=None, worker="t:1:a"
    )


def test_rows_of_the_callers_transaction_are_seen_by_the_read() -> None:
    with transaction.atomic():
        Rated.enqueue({"n": 1})
        Rated.enqueue({"n": 2})
        assert run_until_empty(["rated"]).get("succeeded") == 2


def test_a_row_due_now_by_the_database_clock_is_claimed() -> None:
    RatedSlowly.enqueue({"n": 1})
    WorkItem.objects.update(run_after=Now())
    assert len(_claim()) == 1  # type: ignore[attr-defined]


def test_a_full_window_is_still_reported_and_its_old_starts_still_go() -> None:
    for n in range(3):
        RatedSlowly.enqueue({"n": n})
    got = _claim()
    assert len(got) == 2 and got.full_for is not None  # type: ignore[attr-defined]
    # The window's starts leave it; the next claim (a row is ready) deletes them.
    RateStart.objects.update(started_at=Now() - timedelta(hours=1))
    got = _claim()
    assert len(got) == 1  # type: ignore[attr-defined]
    assert RateStart.objects.filter(handler="rated_slowly").count() == 1


def test_a_ready_row_in_a_paused_queue_is_not_claimed() -> None:
    RatedSlowly.enqueue({"n": 1}, queue="stopped")
    pause_queue("stopped")
    assert _claim() == []  # type: ignore[attr-defined]
