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
from django.db import connections, router
from django.test import override_settings

from django_dbworker import EnqueueError
from django_dbworker.admin import actions
from django_dbworker.batches.models import Dependency
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


# -- after= and a parent read through a primary/replica router ---------------------------
#
# A parent WorkItem whose ``_state.db`` is not the child's write alias is refused
# ("ids are per database") unless ``router.allow_relation`` says the two may be
# related, as Django's own relations ask: the primary/replica router of Django's docs
# reads from a replica that holds the primary's rows under the same ids.


REPLICA = "replica_after"


class PrimaryReplicaRouter:
    """Django docs' primary/replica router, with one replica (the same database here)."""

    def db_for_read(self, model: Any, **hints: Any) -> str:
        return REPLICA

    def db_for_write(self, model: Any, **hints: Any) -> str:
        return "default"

    def allow_relation(self, obj1: Any, obj2: Any, **hints: Any) -> bool | None:
        pool = {"default", REPLICA}
        if obj1._state.db in pool and obj2._state.db in pool:
            return True
        return None

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool:
        return db == "default"


@pytest.fixture
def replica() -> Iterator[None]:
    # A replica of the test database: the same server and database (as a MIRROR is),
    # made as Django makes a dynamic connection (this thread's only).
    connections.settings[REPLICA] = {**connections["default"].settings_dict}
    try:
        conn = connections.create_connection(REPLICA)
    finally:
        del connections.settings[REPLICA]
    setattr(connections._connections, REPLICA, conn)
    try:
        with override_settings(DATABASE_ROUTERS=[f"{__name__}.PrimaryReplicaRouter"]):
            yield
    finally:
        conn.close()
        delattr(connections._connections, REPLICA)


@pytest.mark.django_db(transaction=True)
def test_after_a_parent_read_from_the_replica_is_accepted(replica: None) -> None:
    parent = Noop.enqueue({"n": "parent"})
    assert parent._state.db == "default"
    loaded = WorkItem.objects.get(pk=parent.pk)  # a read: the replica
    assert loaded._state.db == REPLICA
    child = WorkItem(handler="noop")
    child._state.db = "default"
    assert router.allow_relation(loaded, child), "Django would relate them"
    try:
        child = Noop.enqueue({"n": "child"}, after=[loaded])
    except EnqueueError as exc:
        pytest.fail(f"after= refused a parent its router relates to the child: {exc}")
    assert list(
        Dependency.objects.using("default")
        .filter(child_id=child.pk)
        .values_list("parent_id", flat=True)
    ) == [parent.pk]
