"""The admin on 1,000,000 rows (PostgreSQL): fixed query budget, index-driven SQL.

The rows are made once for the module with one INSERT ... SELECT
generate_series (see bench/bigtable.py) and removed afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from bench.bigtable import fill
from django_dbworker.models import Status, WorkItem

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db]

ROWS = 1_000_000
TABLE = WorkItem._meta.db_table


@pytest.fixture(scope="module")
def big_table(django_db_setup: None, django_db_blocker: pytest.FixtureRequest) -> Iterator[None]:
    with django_db_blocker.unblock():  # type: ignore[attr-defined]
        if connection.vendor != "postgresql":
            yield
            return
        fill(ROWS)
        yield
        with connection.cursor() as cursor:
            cursor.execute(f"TRUNCATE {TABLE} RESTART IDENTITY")


def _pages() -> list[tuple[str, str]]:
    failed = (
        WorkItem.objects.filter(status=Status.FAILED)
        .order_by("-pk")
        .values_list("pk", flat=True)[0]
    )
    changelist = reverse("admin:django_dbworker_workitem_changelist")
    return [
        ("work items", changelist),
        ("work items: failed", changelist + "?status__exact=failed"),
        ("work items: pending", changelist + "?status__exact=pending"),
        ("work items: handler", changelist + "?handler=record"),
        ("work items: queue", changelist + "?queue=urgent"),
        ("work items: handler+status", changelist + "?handler=echo&status__exact=succeeded"),
        ("work items: search id", changelist + f"?q={failed}"),
        ("work items: search key", changelist + "?q=no-such-key"),
        ("claimed", reverse("admin:django_dbworker_claimedworkitem_changelist")),
        ("failed", reverse("admin:django_dbworker_failedworkitem_changelist")),
        ("summary", reverse("admin:django_dbworker_queuesummary_changelist")),
        ("detail", reverse("admin:django_dbworker_workitem_change", args=[failed])),
    ]


#: Queries per page: session, user, the page's own (count, rows, filter choices).
BUDGET = 8


def test_every_page_is_fast_by_construction(
    big_table: None, superuser_client: Client, capsys: pytest.CaptureFixture[str]
) -> None:
    assert WorkItem.objects.order_by("-pk").values_list("pk", flat=True)[0] >= ROWS
    report = []
    for label, url in _pages():
        superuser_client.get(url)  # warm caches: measure the steady state
        with CaptureQueriesContext(connection) as ctx:
            started = time.perf_counter()
            response = superuser_client.get(url)
            elapsed = time.perf_counter() - started
        assert response.status_code == 200, label
        queries = ctx.captured_queries
        assert len(queries) <= BUDGET, (label, [q["sql"] for q in queries])
        for query in queries:
            sql = query["sql"]
            if TABLE not in sql or sql.lstrip().upper().startswith("EXPLAIN"):
                continue
            with connection.cursor() as cursor:
                # Re-run the captured SQL's plan; params are already inlined.
                cursor.execute("EXPLAIN " + sql.replace("%", "%%"))
                plan = "\n".join(row[0] for row in cursor.fetchall())
            assert f"Seq Scan on {TABLE}" not in plan, (label, sql, plan)
        report.append(f"{label:28} {len(queries):2} queries  {elapsed * 1000:7.1f} ms")
    with capsys.disabled():
        print(f"\nadmin pages on {ROWS:,} rows:\n  " + "\n  ".join(report))
