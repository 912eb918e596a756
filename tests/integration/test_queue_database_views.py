"""A queue database of its own: the admin, stats, metrics and prune read and act on it.

The work tables live on the ``work`` alias (``QueueRouter``); users, sessions
and the admin's log stay on ``default``. Every page and command is used as an
operator would, and no statement on ``default`` may name a work table.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connections
from django.db.models.functions import Now
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from django_dbworker import batch, pause_queue
from django_dbworker.batches.models import Batch
from django_dbworker.contrib.prometheus.collector import QueueCollector
from django_dbworker.fleet.models import LiveWorker
from django_dbworker.flow.models import QueueState
from django_dbworker.models import Status, WorkItem
from django_dbworker.stats import queue_stats
from tests.factories import make_item
from tests.routers import WORK_ALIAS
from tests.testapp.workers import Echo, Noop

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", WORK_ALIAS])

WORK_TABLES = "django_dbworker_"


@contextmanager
def no_work_statements_on_default() -> Iterator[None]:
    """Fails the test if a statement on ``default`` names a work table."""
    with CaptureQueriesContext(connections["default"]) as queries:
        yield
    stray = [q["sql"] for q in queries.captured_queries if WORK_TABLES in q["sql"]]
    assert stray == []


@pytest.fixture
def nothing_on_default(routed: None) -> Iterator[None]:
    with no_work_statements_on_default():
        yield


@pytest.fixture
def operator(routed: None) -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    return client


def rows(alias: str = WORK_ALIAS) -> Any:
    return WorkItem.objects.using(alias)


def _get(client: Client, url: str) -> str:
    response = client.get(url)
    assert response.status_code == 200, (url, response.status_code)
    return response.content.decode()


def test_every_admin_page_reads_the_queue_database(
    operator: Client, nothing_on_default: None
) -> None:
    failed = make_item(status=Status.FAILED, finished_at=Now(), last_error="Boom: once")
    with batch(on_complete=Echo, payload={"import": 7}) as b:
        parent = Noop.enqueue({"n": 1})
    child = Noop.enqueue({"n": 2}, after=[parent])
    pause_queue("default", by="ops")
    assert {failed._state.db, parent._state.db, b._state.db} == {WORK_ALIAS}

    html = _get(operator, reverse("admin:django_dbworker_workitem_changelist"))
    assert f"/{child.pk}/change/" in html and f"/{failed.pk}/change/" in html
    assert f"/{failed.pk}/change/" in _get(
        operator, reverse("admin:django_dbworker_failedworkitem_changelist")
    )
    _get(operator, reverse("admin:django_dbworker_claimedworkitem_changelist"))
    _get(operator, reverse("admin:django_dbworker_workitem_changelist") + "?status__exact=pending")
    summary = _get(operator, reverse("admin:django_dbworker_queuesummary_changelist"))
    assert "default" in summary
    _get(operator, reverse("admin:django_dbworker_periodicschedule_changelist"))
    queues = operator.get(reverse("admin:django_dbworker_queuestate_changelist"))
    assert {row["name"]: row for row in queues.context["rows"]}["default"]["paused"]
    assert f"/{b.pk}/change/" in _get(operator, reverse("admin:django_dbworker_batch_changelist"))
    _get(operator, reverse("admin:django_dbworker_batch_change", args=[b.pk]))
    # A row's page: its batch and dependencies, read from the queue database too.
    page = _get(operator, reverse("admin:django_dbworker_workitem_change", args=[child.pk]))
    assert f"/{parent.pk}/change/" in page
    page = _get(operator, reverse("admin:django_dbworker_workitem_change", args=[parent.pk]))
    assert f"/{b.pk}/change/" in page
    _get(operator, reverse("admin:django_dbworker_workitem_raw", args=[parent.pk, "payload"]))
    _get(operator, reverse("admin:index"))
    # The live workers, and the link to what one holds.
    worker = LiveWorker.objects.create(name="q-host:9", handlers=["noop"])
    assert worker._state.db == WORK_ALIAS
    claimed = make_item(status=Status.CLAIMED, claimed_by="q-host:9:dbworker_0", claimed_at=Now())
    workers = _get(operator, reverse("admin:django_dbworker_liveworker_changelist"))
    assert 'data-name="q-host:9"' in workers
    held = reverse("admin:django_dbworker_claimedworkitem_changelist") + "?worker=q-host:9"
    assert f"/{claimed.pk}/change/" in _get(operator, held)


def test_admin_actions_change_rows_on_the_queue_database(
    operator: Client, nothing_on_default: None
) -> None:
    failed = make_item(status=Status.FAILED, finished_at=Now())
    pending = [Noop.enqueue({"n": n}, run_after=timedelta(hours=1)) for n in range(2)]
    changelist = reverse("admin:django_dbworker_workitem_changelist")

    response = operator.post(
        changelist, {"action": "retry", "_selected_action": [failed.pk]}, follow=True
    )
    assert "1 work item(s) set to pending for a new run." in response.content.decode()
    assert rows().get(pk=failed.pk).status == Status.PENDING
    operator.post(changelist, {"action": "cancel", "_selected_action": [pending[0].pk]})
    assert rows().get(pk=pending[0].pk).status == Status.CANCELLED
    # A row's own button, and "Run now".
    url = reverse("admin:django_dbworker_workitem_row_action", args=[pending[1].pk, "run_now"])
    assert operator.post(url).status_code == 302
    assert rows().filter(pk=pending[1].pk, run_after__lte=Now()).exists()
    # Pause from the queues page: the state is stored with the work.
    operator.post(
        reverse("admin:django_dbworker_queuestate_changelist"),
        {"action": "pause", "queue": "default"},
    )
    assert QueueState.objects.using(WORK_ALIAS).get(name="default").paused
    # The admin's own log is the project's, on default.
    assert LogEntry.objects.using("default").filter(object_repr="default").exists()


def test_stats_and_metrics_read_the_queue_database(nothing_on_default: None) -> None:
    Noop.enqueue_many([{"n": n} for n in range(3)])
    make_item(status=Status.FAILED, finished_at=Now())
    assert queue_stats()["default"]["counts"] == {"pending": 3, "failed": 1}
    out = StringIO()
    call_command("dbworker_stats", stdout=out)
    assert "pending" in out.getvalue() and "failed" in out.getvalue()
    LiveWorker.objects.create(name="q-host:9", handlers=["noop"])
    out = StringIO()
    call_command("dbworker_stats", stdout=out)
    assert "Workers: 1 live" in out.getvalue()
    samples = {
        s.labels.get("status"): s.value
        for family in QueueCollector().collect()
        if family.name == "dbworker_queue_items"
        for s in family.samples
        if s.labels["queue"] == "default"
    }
    assert (samples["pending"], samples["failed"]) == (3, 1)


def test_prune_deletes_on_the_queue_database() -> None:
    # The same kind of row on default: not the queue's, and not pruned by it.
    elsewhere = WorkItem.objects.create(
        handler="noop", payload={}, max_attempts=1, status=Status.SUCCEEDED
    )
    WorkItem.objects.filter(pk=elsewhere.pk).update(finished_at=Now() - timedelta(days=10))
    with override_settings(DATABASE_ROUTERS=["tests.routers.QueueOnWork"]):
        old = make_item(status=Status.SUCCEEDED, finished_at=Now() - timedelta(days=10))
        recent = make_item(status=Status.SUCCEEDED, finished_at=Now())
        live = make_item()
        out = StringIO()
        with no_work_statements_on_default():
            call_command("dbworker_prune", "--older-than", "7d", stdout=out)
    assert "1" in out.getvalue()
    assert set(rows().values_list("pk", flat=True)) == {recent.pk, live.pk}
    assert old.pk not in set(rows().values_list("pk", flat=True))
    assert rows("default").filter(pk=elsewhere.pk).exists()


def test_a_completed_batch_is_pruned_with_its_items(nothing_on_default: None) -> None:
    from django_dbworker.testing import run_until_empty

    with batch(on_complete=Echo) as b:
        Noop.enqueue({"n": 1})
    assert run_until_empty() == {"succeeded": 2}  # the item, then the callback
    rows().update(finished_at=Now() - timedelta(days=10))
    Batch.objects.using(WORK_ALIAS).update(completed_at=Now() - timedelta(days=10))
    call_command("dbworker_prune", "--older-than", "7d", stdout=StringIO())
    assert not rows().exists()
    assert not Batch.objects.using(WORK_ALIAS).filter(pk=b.pk).exists()


def test_the_tasks_backend_enqueues_and_reads_results_on_the_queue_database(
    nothing_on_default: None,
) -> None:
    from django_dbworker.testing import run_until_empty
    from tests.testapp.tasks import add

    result = add.enqueue(2, 3)
    assert rows().filter(pk=int(result.id)).exists()
    assert run_until_empty() == {"succeeded": 1}
    fetched = add.get_result(result.id)
    assert fetched.status == "SUCCESSFUL" and fetched.return_value == 5
