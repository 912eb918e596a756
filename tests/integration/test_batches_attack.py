"""Attacks on batches and ``after=`` dependencies (issue 22): each test proves a bug.

Every test here FAILS against the core change it attacks (commit cafd496);
its docstring says the scenario and what SPEC "Batches and dependencies"
requires. Scenarios that were tried and held are in ``test_batches_races.py``.
Real databases only; interleavings are forced with threads that own their
connections and explicit transactions, waited on with bounded waits.
"""

from __future__ import annotations

import pytest

from django_dbworker import EnqueueError
from django_dbworker.models import Dependency, Status, WorkItem
from tests.factories import claim, run_retries
from tests.testapp.workers import AlwaysFail, Record

pytestmark = pytest.mark.django_db(transaction=True)


# -- operator retry breaks the "after every parent succeeded" rule -------------------


def test_retrying_a_cancelled_waiting_child_does_not_run_it_before_its_parent() -> None:
    """An operator cancels a waiting child, then retries it, while its parent is still pending.

    SPEC: "the item is not claimed until every listed item has succeeded".
    ``QuerySet.retry`` sets the row ``pending`` and due now, but leaves
    ``waiting`` False (``cancel_pending`` cleared it) and ignores the row's
    ``Dependency`` links: the next claim takes the child while its parent
    has not even started. (models.py ``retry``: ``changes`` never looks at
    the parents.) Expected: the retried child waits again (``waiting``,
    run_after in year 9999) until the parent succeeds.
    """
    parent = Record.enqueue({"key": "parent"})
    child = Record.enqueue({"key": "child"}, after=[parent])
    assert WorkItem.objects.get(pk=child.pk).waiting
    child.cancel()
    assert WorkItem.objects.filter(pk=child.pk).retry() == 1
    claimed = {item.pk for item in claim(handlers=["record"])}
    assert child.pk not in claimed, "the child was claimed before its parent succeeded"
    assert claimed == {parent.pk}


def test_retrying_a_cancelled_chain_runs_the_links_in_order() -> None:
    """A chain a -> b -> c whose head failed: b and c were cancelled without running. The
    operator fixes the cause and retries every failed and cancelled row (the admin's
    "Retry" on the Failed/Cancelled filter).

    SPEC: b "is not claimed until every listed item has succeeded". After the
    retry all three are plain due rows: one claim takes a, b and c together,
    so b and c run beside (or before) a. Expected: b and c wait for their
    (now pending again) parents, and run in chain order.
    """
    a = AlwaysFail.enqueue({"key": "a"})
    b = Record.enqueue({"key": "b"}, after=[a])
    c = Record.enqueue({"key": "c"}, after=[b])
    run_retries()
    assert set(WorkItem.objects.filter(pk__in=[b.pk, c.pk]).values_list("status", flat=True)) == {
        Status.CANCELLED
    }
    assert Dependency.objects.filter(child_id__in=[b.pk, c.pk]).count() == 2
    assert WorkItem.objects.filter(status__in=[Status.FAILED, Status.CANCELLED]).retry() == 3
    claimed = {item.pk for item in claim(handlers=["always_fail", "record"])}
    assert claimed == {a.pk}, (
        f"claimed {sorted(claimed)}: b (#{b.pk}) and c (#{c.pk}) were claimed beside "
        f"their parent a (#{a.pk})"
    )


# -- bad after= values -------------------------------------------------------------


@pytest.mark.parametrize("pk", [2**63, -(2**63) - 1, 2**70])
def test_an_id_out_of_the_databases_range_is_an_enqueue_error(pk: int) -> None:
    """``after=[id]`` with an id no row can have (outside the 64-bit range of the id column).

    SPEC: "a parent that does not exist is an EnqueueError". On SQLite the
    lookup ``pk__in=[2**63]`` raises ``OverflowError`` ("Python int too
    large to convert to SQLite INTEGER") from the driver
    (dependencies.py ``lock_parents``), not ``EnqueueError``. Expected: the
    same "do not exist" ``EnqueueError`` as for any other missing id.
    """
    with pytest.raises(EnqueueError, match="do not exist"):
        Record.enqueue({}, after=[pk])
    assert not WorkItem.objects.exists()
