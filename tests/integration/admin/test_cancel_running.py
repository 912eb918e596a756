"""The admin's Cancel on running work: asks claimed rows to stop, shows and filters the mark."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from django_dbworker.models import Status, WorkItem
from tests.factories import claim, make_item

pytestmark = pytest.mark.django_db

WORK_ITEMS = "admin:django_dbworker_workitem_changelist"
CLAIMED = "admin:django_dbworker_claimedworkitem_changelist"


@pytest.fixture
def rows() -> dict[str, WorkItem]:
    found = {"pending": make_item(handler="echo"), "failed": make_item(status=Status.FAILED)}
    make_item(handler="urgent")
    make_item(handler="urgent")
    found["running"], found["other"] = claim(limit=2, handlers=["urgent"])
    return found


def test_cancel_reports_cancelled_and_asked_rows(superuser_client: Client, rows: dict) -> None:
    response = superuser_client.post(
        reverse(WORK_ITEMS),
        {"action": "cancel", "_selected_action": [rows[k].pk for k in ("pending", "running")]},
        follow=True,
    )
    text = response.content.decode()
    assert "1 work item(s) cancelled." in text
    assert "1 skipped: not pending; 1 of them running, asked to stop" in text
    assert WorkItem.objects.get(pk=rows["pending"].pk).status == Status.CANCELLED
    running = WorkItem.objects.get(pk=rows["running"].pk)
    assert running.status == Status.CLAIMED
    assert running.cancel_requested_at is not None
    assert WorkItem.objects.get(pk=rows["other"].pk).cancel_requested_at is None


def test_cancel_is_offered_on_the_claimed_list(superuser_client: Client, rows: dict) -> None:
    html = superuser_client.get(reverse(CLAIMED)).content.decode()
    assert '<option value="cancel">' in html
    response = superuser_client.post(
        reverse(CLAIMED),
        {"action": "cancel", "_selected_action": [rows["running"].pk, rows["other"].pk]},
        follow=True,
    )
    text = response.content.decode()
    assert "0 work item(s) cancelled. 2 skipped: not pending; 2 of them running" in text
    assert WorkItem.objects.cancel_requested().count() == 2


def test_cancel_on_the_claimed_list_needs_the_change_permission(
    viewer_client: Client, rows: dict
) -> None:
    html = viewer_client.get(reverse(CLAIMED)).content.decode()
    assert 'name="action"' not in html
    viewer_client.post(
        reverse(CLAIMED), {"action": "cancel", "_selected_action": [rows["running"].pk]}
    )
    assert WorkItem.objects.get(pk=rows["running"].pk).cancel_requested_at is None


def test_the_mark_shows_as_a_badge_and_filters(superuser_client: Client, rows: dict) -> None:
    rows["running"].cancel()
    for page in (WORK_ITEMS, CLAIMED):
        html = superuser_client.get(reverse(page)).content.decode()
        assert html.count('class="dbw-cancel-requested"') == 1, page
        listed = superuser_client.get(reverse(page), {"cancel_requested": "yes"})
        assert listed.status_code == 200
        body = listed.content.decode()
        assert f'value="{rows["running"].pk}"' in body, page
        assert f'value="{rows["other"].pk}"' not in body, page


def test_the_row_page_shows_snoozes_and_the_request(superuser_client: Client, rows: dict) -> None:
    WorkItem.objects.filter(pk=rows["running"].pk).update(snoozes=7)
    rows["running"].cancel()
    url = reverse("admin:django_dbworker_workitem_change", args=[rows["running"].pk])
    html = superuser_client.get(url).content.decode()
    assert "snoozes" in html and '<div class="readonly">7</div>' in html
    assert "cancel requested at" in html.lower()
