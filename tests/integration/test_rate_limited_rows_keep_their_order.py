"""A rate-limited handler's rows start in claim order (priority, then ``run_after``, then id),
window after window.

Rate limits count starts (``flow/rates.py``): rows of a rated handler are claimed and
buffered like any others, and those its full window refuses go back to pending. Going back
must not move them behind the rows that were never claimed: with ``run_after`` reset to
"now" at the give-back, the rows a window refused (the oldest of the backlog) wait until
the whole backlog behind them has run.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from django_dbworker.models import Status, WorkItem
from django_dbworker.worker import Worker
from tests.conftest import wait_until
from tests.testapp.workers import Rated

pytestmark = pytest.mark.django_db(transaction=True)


def test_rows_refused_by_a_full_window_start_before_the_rows_behind_them(
    background_worker: Callable[..., Worker],
) -> None:
    items = Rated.enqueue_many([{"key": str(n)} for n in range(70)])
    order = [item.pk for item in items]  # one run_after for all: claim order is the id's
    # 20 starts a second; claims of 10 rows at most, so the backlog is claimed window by window.
    background_worker(["rated"], concurrency=2, batch_size=10)
    done = WorkItem.objects.filter(handler="rated", status=Status.SUCCEEDED)
    wait_until(lambda: done.count() == 70, timeout=20, what="the 70 rated rows to run")
    # The handler returns its start time (time.time()): the rows by when they started.
    started = sorted(done.values_list("result", "pk"))
    position = {pk: n for n, (_, pk) in enumerate(started)}
    # Two threads and a claim of ten rows may swap neighbours; no row may start dozens of
    # places late.
    late = {pk: position[pk] - n for n, pk in enumerate(order) if position[pk] - n > 12}
    assert not late, f"rows that started far behind their place in claim order: {late}"
