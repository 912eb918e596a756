"""Attack s7b: after= and a parent read through a primary/replica router (ed2d974).

ed2d974 refuses a parent WorkItem whose ``_state.db`` is not the child's write
alias ("ids are per database"). Django's own test of whether two objects may be
related is ``router.allow_relation`` (a foreign key assignment, ``Model.save``'s
relations): the primary/replica router of Django's docs ("Multiple databases",
an example) reads from a replica and says objects of the pool may be related,
since a replica holds the primary's rows under the same ids. A project with
such a router reads a WorkItem (on the replica, as every read) and enqueues a
child ``after=[item]``: now an EnqueueError, though the parent's id names the
same row on the child's database.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections, router
from django.test import override_settings

from django_dbworker import EnqueueError
from django_dbworker.batches.models import Dependency
from django_dbworker.models import WorkItem
from tests.testapp.workers import Noop

pytestmark = pytest.mark.django_db(transaction=True)

REPLICA = "replica_s7b"


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
