"""A rate window counts each start once, also after the database's clock stepped back.

``take_start`` counts starts dated after the database's "now" (the clock stepped back: an
NTP step, a restored VM, a failover to a lagging replica) as the current bucket's
(``flow/rates.py``). Several buckets of the last window then share the current bucket's
time: a start added to "the current bucket" must add one start, not one per row that now
carries that time.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models import Sum
from django.db.models.functions import Now

from django_dbworker.db import operations
from django_dbworker.flow.models import RateStart
from django_dbworker.flow.rates import take_start

pytestmark = pytest.mark.django_db(transaction=True)


def _take(starts: int, period: float) -> float | None:
    return take_start(operations(), handler="rated", starts=starts, period=period)


def test_starts_after_a_clock_step_back_are_counted_once_each() -> None:
    # The last window's five buckets, one start each, dated 1 to 5 minutes ahead of the
    # database's clock (it stepped back five minutes; the period is an hour).
    for minutes in range(1, 6):
        row = RateStart.objects.create(handler="rated", count=1)
        RateStart.objects.filter(pk=row.pk).update(started_at=Now() + timedelta(minutes=minutes))
    taken = [_take(starts=100, period=3600.0) for _ in range(30)]
    total = RateStart.objects.filter(handler="rated").aggregate(n=Sum("count"))["n"]
    # 5 + 30 starts in a window of 100: every one taken, each counted once.
    assert taken.count(None) == 30, f"{30 - taken.count(None)} of 30 starts refused"
    assert total == 35, f"the window counts {total} starts for 35"
