"""An idle rate-limited handler costs one read per poll, not the window's transaction.

With nothing of the handler pending, its claim locked the handler's
``FlowLock`` row, counted its window, claimed nothing and deleted the
starts that left it: six statements, a commit and a row lock per process
per poll (50 idle processes took the lock 50 times a second,
docs/scale.md). Nothing to claim now costs one indexed read, and takes no
lock that busy claimers of the handler would queue on.
"""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_dbworker.flow.models import FlowLock
from tests.factories import claim_rated, make_item

pytestmark = pytest.mark.django_db


def _claim() -> object:
    return claim_rated(handler="rated", starts=5, period=1.0, limit=4, queues=None, worker="t:1:a")


def test_nothing_pending_is_one_read_and_no_lock() -> None:
    make_item("noop")  # another handler's row does not count
    with CaptureQueriesContext(connection) as queries:
        got = _claim()
    assert got == [] and got.full_for is None  # type: ignore[attr-defined]
    statements = [q["sql"] for q in queries.captured_queries]
    assert len(statements) == 1, statements
    assert "FOR UPDATE" not in statements[0]
    assert not FlowLock.objects.filter(name="rate:rated").exists()


def test_a_pending_row_is_still_claimed_under_the_window() -> None:
    make_item("rated", payload={"key": "a"})
    got = _claim()
    assert len(got) == 1  # type: ignore[attr-defined]
    assert FlowLock.objects.filter(name="rate:rated").exists()
