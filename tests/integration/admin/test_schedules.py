"""The admin's Schedules page: schedules in words, next and last slot, "Run now"."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.test import Client
from django.urls import reverse

from django_dbworker.models import PeriodicSchedule, Status, WorkItem
from django_dbworker.worker.scheduler import ensure_schedules, take_slot
from tests.testapp.workers import Nightly

pytestmark = pytest.mark.django_db

URL = "admin:django_dbworker_periodicschedule_changelist"
SLOT = datetime(2024, 5, 1, 1, 0, tzinfo=UTC)


def row_html(html: str, name: str) -> str:
    start = html.index(f'data-name="{name}"')
    return html[start : html.index("</tr>", start)]


def test_the_page_lists_each_periodic_handler_with_schedule_next_and_last_run(
    superuser_client: Client,
) -> None:
    ensure_schedules(["nightly"], using="default")
    take_slot(Nightly, SLOT, using="default")
    WorkItem.objects.filter(handler="nightly").update(status=Status.SUCCEEDED)
    html = superuser_client.get(reverse(URL)).content.decode()
    nightly = row_html(html, "nightly")
    assert "at 03:00 every day (Europe/Paris)" in nightly
    assert "reports" in nightly
    assert "2024-05-01 01:00:00 UTC" in nightly  # last slot
    assert "succeeded" in nightly
    assert "Run now" in nightly
    # The latest 03:00 in Paris is due: no worker has taken it since 2024.
    assert " UTC (due now)" in nightly
    tick = row_html(html, "tick")
    assert "every second" in tick and "never run" in tick
    assert " UTC (in " in tick
    index = superuser_client.get(reverse("admin:app_list", args=["django_dbworker"]))
    assert "Schedules" in index.content.decode()


def test_run_now_enqueues_an_extra_run_and_leaves_the_schedule(superuser_client: Client) -> None:
    ensure_schedules(["nightly"], using="default")
    take_slot(Nightly, SLOT, using="default")
    response = superuser_client.post(reverse(URL), {"run_now": "nightly"}, follow=True)
    assert "Enqueued an extra run of nightly" in response.content.decode()
    extra = WorkItem.objects.filter(handler="nightly").exclude(unique_key=SLOT.isoformat()).get()
    assert extra.payload["manual"] is True and extra.unique_key is None
    assert extra.queue == "reports"
    row = PeriodicSchedule.objects.get(name="nightly")
    assert row.last_slot == SLOT and row.last_item_id != extra.pk


def test_run_now_of_an_unknown_name_enqueues_nothing(superuser_client: Client) -> None:
    response = superuser_client.post(reverse(URL), {"run_now": "record"}, follow=True)
    assert "Nothing enqueued" in response.content.decode()
    assert not WorkItem.objects.exists()


def test_view_only_staff_sees_the_page_but_cannot_run_now(viewer_client: Client) -> None:
    response = viewer_client.get(reverse(URL))
    assert response.status_code == 200
    assert 'value="Run now"' not in response.content.decode()
    assert viewer_client.post(reverse(URL), {"run_now": "nightly"}).status_code == 403
    assert not WorkItem.objects.exists()


def test_staff_without_permission_is_forbidden(staff_client: Client) -> None:
    assert staff_client.get(reverse(URL)).status_code == 403
