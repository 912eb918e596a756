"""Attack (session 7): which database the work paths use when the work is on two aliases.

``after=`` takes work items (or ids): an item names its own database
(``item._state.db``), yet the parents are looked up on the database the child
is written to. A parent enqueued on the ``work`` alias (``using="work"``, as
the docs allow: an explicit alias wins over the routers) given to an enqueue
that goes to ``default`` is then matched by id against ``default``'s rows: if
one has that id, the child silently waits for, and is settled by, an
unrelated row. ``batch()`` refuses the same mismatch ("a batch's items share
its database"); ``after=`` should too.
"""

from __future__ import annotations

import pytest
from django.core.management.color import no_style
from django.db import connections

from django_dbworker import EnqueueError
from django_dbworker.batches.models import Dependency
from django_dbworker.models import Status, WorkItem
from tests.routers import WORK_ALIAS
from tests.testapp.workers import Noop

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", WORK_ALIAS])


def test_after_a_parent_of_another_database_is_refused_not_matched_by_id() -> None:
    parent = Noop.enqueue({"n": "parent"}, using=WORK_ALIAS)
    assert parent._state.db == WORK_ALIAS
    # default holds an unrelated row with the same id (ids are per database).
    WorkItem.objects.using("default").filter(pk=parent.pk).delete()
    stranger = WorkItem.objects.using("default").create(
        pk=parent.pk,
        handler="noop",
        payload={"n": "stranger"},
        max_attempts=1,
        status=Status.FAILED,
    )
    default = connections["default"]
    with default.cursor() as cursor:  # default's ids go on after the stranger's
        for sql in default.ops.sequence_reset_sql(no_style(), [WorkItem]):
            cursor.execute(sql)
    try:
        child = Noop.enqueue({"n": "child"}, after=[parent])
    except EnqueueError:
        return  # refused: the parent is not on the child's database
    # Accepted: the child waits for default's row, and is settled by it.
    links = list(
        Dependency.objects.using("default")
        .filter(child_id=child.pk)
        .values_list("parent_id", flat=True)
    )
    child.refresh_from_db()
    pytest.fail(
        f"child #{child.pk} on {child._state.db!r} was linked to {links} there "
        f"(default's row #{stranger.pk}, {stranger.status}) for parent #{parent.pk} on "
        f"{parent._state.db!r}; it is now {child.status}: {child.last_error[:120]!r}"
    )
