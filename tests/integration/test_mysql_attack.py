"""Attack tests on the MySQL/MariaDB support (issue 13): each shows a bug."""

from __future__ import annotations

import pytest

from django_dbworker.enqueuing import insert as enqueue_or_get
from django_dbworker.models import Status, WorkItem
from tests.factories import make_item

pytestmark = [pytest.mark.mysql_only, pytest.mark.django_db(transaction=True)]


# -- unique_key and PAD SPACE ----------------------------------------------------------
#
# Migration 0005 gives unique_key the collation utf8mb4_bin, which is PAD
# SPACE on MariaDB and on MySQL 8: 'k' = 'k ' in every comparison. The unique
# index is on a VARBINARY column, where they differ. So the database keeps
# 'k' and 'k ' live side by side (as PostgreSQL does) but every lookup by
# key (enqueue's "return the live row", retry()'s live-twin test) confuses
# them.


def test_enqueue_again_returns_the_row_of_its_own_key_not_one_with_a_trailing_space() -> None:
    spaced, added = enqueue_or_get("noop", {}, unique_key="k ")
    assert added
    plain, added = enqueue_or_get("noop", {}, unique_key="k")
    assert added and plain.pk != spaced.pk  # distinct keys, as on PostgreSQL
    again, added = enqueue_or_get("noop", {}, unique_key="k")
    assert not added
    assert again.unique_key == "k", (
        f"enqueue(unique_key='k') returned the row of key {again.unique_key!r}"
    )
    assert again.pk == plain.pk


def test_retry_is_not_blocked_by_a_live_row_whose_key_only_differs_by_trailing_space() -> None:
    failed = make_item(unique_key="k", status=Status.FAILED)
    make_item(unique_key="k  ")  # pending, a different key
    assert WorkItem.objects.filter(pk=failed.pk).retry() == 1, (
        "retry() skipped a failed row: it took 'k  ' for a live twin of 'k'"
    )
