"""Prune walks the table once: each batch starts after the last id the previous one chose.

Each batch's choice was the first ``batch_size`` eligible rows by id, from
the start: the rows deleted by earlier batches stay in the index as dead
entries until VACUUM, and every choice walked them again. 3.7 million rows
into a prune of 10 million, a batch's choice took 37.9 ms and 2,544 buffers
against 4.6 ms for its DELETE (bench/scale_history.py, docs/scale.md), so
the prune slowed as it went.
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext

from django_dbworker.models import Status, WorkItem
from django_dbworker.retention import prune

pytestmark = pytest.mark.django_db


def test_each_batch_is_chosen_after_the_last_id_of_the_one_before() -> None:
    WorkItem.objects.bulk_create(
        WorkItem(handler="noop", payload={}, max_attempts=3, status=Status.SUCCEEDED)
        for _ in range(7)
    )
    WorkItem.objects.update(finished_at=Now() - timedelta(days=2))
    ids = sorted(WorkItem.objects.values_list("pk", flat=True))
    with CaptureQueriesContext(connection) as queries:
        deleted = prune(older_than=timedelta(days=1), statuses=[Status.SUCCEEDED], batch_size=3)
    assert deleted == 7
    assert not WorkItem.objects.exists()
    choices = [
        q["sql"]
        for q in queries.captured_queries
        if q["sql"].startswith("SELECT") and "ORDER BY" in q["sql"] and "LIMIT 3" in q["sql"]
    ]
    assert len(choices) == 4, choices  # 3 + 3 + 1, then none left
    assert not re.search(r"[`\"]id[`\"] > ", choices[0]), choices[0]
    for choice, last in zip(choices[1:], (ids[2], ids[5], ids[6]), strict=True):
        assert re.search(rf'[`"]id[`"] > {last}\b', choice), (
            f"a batch chosen from the start of the table again, not after id {last}: {choice}"
        )
