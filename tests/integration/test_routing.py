"""One database alias rule: Django's routers, with ``using=`` / ``--database`` winning.

The work table lives on a second alias (``work``) here, sent there by a
router; everything that touches it must follow, and nothing may land on
``default``.
"""

from __future__ import annotations

from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.test import override_settings

from django_dbworker.admin import actions
from django_dbworker.contrib.prometheus.collector import QueueCollector, register
from django_dbworker.models import Status, WorkItem
from django_dbworker.stats import orphaned_handlers, queue_stats
from tests.routers import WORK_ALIAS
from tests.testapp.workers import Noop

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", WORK_ALIAS])


@pytest.fixture
def routed() -> Iterator[None]:
    with override_settings(DATABASE_ROUTERS=["tests.routers.WorkOnSecondAlias"]):
        yield


def rows(alias: str) -> Any:
    return WorkItem.objects.using(alias)


class _Admin:
    def __init__(self) -> None:
        self.messages: list[str] = []

    def message_user(self, request: Any, text: str, level: Any) -> None:
        self.messages.append(text)


def test_enqueue_model_methods_admin_and_stats_follow_the_routers(routed: None) -> None:
    item = Noop.enqueue({"n": 1})
    many = Noop.enqueue_many([{"n": 2}, {"n": 3}])
    assert item._state.db == WORK_ALIAS
    assert rows(WORK_ALIAS).count() == 3
    assert not rows("default").exists()

    # An explicit using= wins.
    Noop.enqueue({"n": 4}, using="default")
    assert rows("default").count() == 1

    # Model methods write where the routers say.
    assert item.cancel() and rows(WORK_ALIAS).get(pk=item.pk).status == Status.CANCELLED
    assert item.retry() and rows(WORK_ALIAS).get(pk=item.pk).status == Status.PENDING
    assert item.run_now()

    # Admin actions: the selection is re-read and updated on the write alias.
    admin = _Admin()
    actions.cancel(admin, None, WorkItem.objects.filter(pk__in=[i.pk for i in many]))  # type: ignore[arg-type]
    assert admin.messages == ["2 work item(s) cancelled."]
    assert rows(WORK_ALIAS).filter(status=Status.CANCELLED).count() == 2

    # Reads: stats, the dbworker_stats command, the Prometheus collector.
    stats = queue_stats()
    assert stats["default"]["counts"] == {"pending": 1, "cancelled": 2}
    assert queue_stats(using="default")["default"]["counts"] == {"pending": 1}
    assert orphaned_handlers() == []
    out = StringIO()
    call_command("dbworker_stats", stdout=out)
    assert "cancelled" in out.getvalue()
    samples = {
        (s.labels["queue"], s.labels.get("status")): s.value
        for family in QueueCollector().collect()
        for s in family.samples
        if family.name == "dbworker_queue_items"
    }
    assert samples[("default", "cancelled")] == 2


@pytest.fixture
def queue_collector() -> Iterator[None]:
    # run_workers takes the web process's queue collector off the global
    # registry (each worker would report the same numbers); put it back.
    yield
    register()


def test_run_workers_claims_on_the_routed_alias(routed: None, queue_collector: None) -> None:
    items = Noop.enqueue_many([{"n": n} for n in range(3)])
    stay = Noop.enqueue({"n": "elsewhere"}, using="default")
    call_command("run_workers", "noop", "--burst", "--concurrency", "2")
    assert set(rows(WORK_ALIAS).values_list("status", flat=True)) == {Status.SUCCEEDED}
    assert rows(WORK_ALIAS).count() == len(items)
    assert rows("default").get(pk=stay.pk).status == Status.PENDING
    # --database wins over the routers.
    call_command("run_workers", "noop", "--burst", "--database", "default")
    assert rows("default").get(pk=stay.pk).status == Status.SUCCEEDED


def test_testing_helpers_follow_the_routers(routed: None) -> None:
    from django_dbworker.testing import assert_enqueued, run_until_empty

    Noop.enqueue({"n": 1})
    assert_enqueued(Noop, {"n": 1}, count=1)
    assert run_until_empty([Noop]) == {"succeeded": 1}
