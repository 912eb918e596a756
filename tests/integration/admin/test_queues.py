"""The Queues page: every known queue, live counts, who paused it and when, Pause/Resume."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry
from django.test import Client

from django_dbworker import pause_queue
from django_dbworker.flow.models import QueueState
from django_dbworker.models import Status
from tests.factories import claim, make_item
from tests.integration.admin.conftest import _staff

pytestmark = pytest.mark.django_db

URL = "/admin/django_dbworker/queuestate/"


def test_the_page_lists_known_queues_with_counts_and_pauses(superuser_client: Client) -> None:
    for _ in range(3):
        make_item(queue="emails")
    make_item(queue="emails", status=Status.SUCCEEDED)
    claim(limit=1, queues=["emails"])
    pause_queue("emails", by="ops")
    page = superuser_client.get(URL)
    assert page.status_code == 200
    html = page.content.decode()
    rows = {row["name"]: row for row in page.context["rows"]}
    assert (rows["emails"]["pending"], rows["emails"]["claimed"]) == (2, 1)
    assert rows["emails"]["paused"] and rows["emails"]["paused_by"] == "ops"
    assert not rows["default"]["paused"]
    assert "echoes" in rows  # a handler's default queue, without rows
    assert 'value="Resume"' in html and 'value="Pause"' in html


def test_pause_and_resume_from_the_page(superuser_client: Client) -> None:
    make_item(queue="emails")
    response = superuser_client.post(URL, {"action": "pause", "queue": "emails"})
    assert response.status_code == 302
    state = QueueState.objects.get(name="emails")
    assert state.paused and state.paused_by == "root"
    assert LogEntry.objects.filter(object_repr="emails").exists()
    superuser_client.post(URL, {"action": "resume", "queue": "emails"})
    assert not QueueState.objects.get(name="emails").paused


def test_an_unknown_queue_is_a_message_not_an_error(superuser_client: Client) -> None:
    response = superuser_client.post(URL, {"action": "pause", "queue": "nope"}, follow=True)
    assert "Unknown queue &#x27;nope&#x27;" in response.content.decode()
    assert not QueueState.objects.exists()


def test_pausing_needs_the_change_permission_on_queues(viewer_client: Client) -> None:
    make_item(queue="emails")
    page = viewer_client.get(URL)
    assert page.status_code == 200  # work item viewers see the page
    assert 'value="Pause"' not in page.content.decode()
    assert viewer_client.post(URL, {"action": "pause", "queue": "emails"}).status_code == 403
    assert not QueueState.objects.exists()

    changer = Client()
    changer.force_login(_staff("queue-changer", "change_queuestate"))
    assert changer.post(URL, {"action": "pause", "queue": "emails"}).status_code == 302
    assert QueueState.objects.get(name="emails").paused


def test_staff_without_permission_is_forbidden(staff_client: Client) -> None:
    assert staff_client.get(URL).status_code == 403


def test_the_queue_summary_marks_paused_queues(superuser_client: Client) -> None:
    make_item(queue="emails")
    make_item(queue="other")
    pause_queue("emails")
    page = superuser_client.get("/admin/django_dbworker/queuesummary/")
    rows = {row["queue"]: row for row in page.context["rows"]}
    assert rows["emails"]["paused"] and not rows["other"]["paused"]
    assert 'class="dbw-paused"' in page.content.decode()
