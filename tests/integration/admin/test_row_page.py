"""A row's change page: Retry / Cancel / Run now buttons, and claim fields only on claimed rows."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse

from django_dbworker.models import Status, WorkItem
from tests.factories import claim, make_item

pytestmark = pytest.mark.django_db


def change_url(item: WorkItem, page: str = "workitem") -> str:
    return reverse(f"admin:django_dbworker_{page}_change", args=[item.pk])


def button_url(item: WorkItem, name: str, page: str = "workitem") -> str:
    return reverse(f"admin:django_dbworker_{page}_row_action", args=[item.pk, name])


def buttons(html: str) -> list[str]:
    return re.findall(
        r'<button type="submit" class="dbw-row-action" name="action" value="(\w+)"', html
    )


def test_claim_fields_are_hidden_on_a_row_that_is_not_claimed(superuser_client: Client) -> None:
    # A row that ran once and was retried keeps the old claim's values.
    retried = make_item(
        handler="echo",
        claimed_by="old-host:1:MainThread",
        claim_token="3f0c7d4e-0000-4000-8000-000000000000",
    )
    html = superuser_client.get(change_url(retried)).content.decode()
    assert "old-host" not in html and "3f0c7d4e" not in html
    assert "claimed by" not in html.lower() and "heartbeat at" not in html


def test_claim_fields_are_shown_on_a_claimed_row(superuser_client: Client) -> None:
    make_item(handler="urgent", queue="urgent")
    (claimed,) = claim(limit=1, handlers=["urgent"], worker="web-9:77:MainThread")
    html = superuser_client.get(change_url(claimed)).content.decode()
    assert "web-9:77:MainThread" in html and "Heartbeat at" in html


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (Status.FAILED, ["retry"]),
        (Status.CANCELLED, ["retry"]),
        (Status.PENDING, ["cancel", "run_now"]),
        (Status.SUCCEEDED, []),
        (Status.CLAIMED, ["cancel"]),  # asks the running handler to stop
    ],
)
def test_each_button_shows_only_where_the_rows_state_allows_it(
    superuser_client: Client, status: str, expected: list[str]
) -> None:
    item = make_item(handler="echo", status=status)
    html = superuser_client.get(change_url(item)).content.decode()
    assert buttons(html) == expected
    for name in expected:
        assert f'action="{button_url(item, name)}"' in html
    assert html.count('name="csrfmiddlewaretoken"') >= len(expected)


def test_read_only_users_see_no_buttons(viewer_client: Client) -> None:
    item = make_item(handler="echo", status=Status.FAILED)
    html = viewer_client.get(change_url(item)).content.decode()
    assert buttons(html) == []


def test_retry_from_the_row_page_redirects_back_with_the_lists_message(
    superuser_client: Client,
) -> None:
    item = make_item(handler="echo", status=Status.FAILED, attempts=3)
    response = superuser_client.post(button_url(item, "retry"))
    assert response.status_code == 302 and response["Location"] == change_url(item)
    page = superuser_client.get(response["Location"]).content.decode()
    assert "1 work item(s) set to pending for a new run." in page
    row = WorkItem.objects.get(pk=item.pk)
    assert (row.status, row.attempts) == (Status.PENDING, 0)
    # Now pending: Cancel and Run now, no Retry.
    assert buttons(page) == ["cancel", "run_now"]


def test_a_row_that_leaves_its_page_is_shown_on_the_work_items_page(
    superuser_client: Client,
) -> None:
    item = make_item(handler="echo", status=Status.FAILED, attempts=3)
    html = superuser_client.get(change_url(item, "failedworkitem")).content.decode()
    assert buttons(html) == ["retry"]
    response = superuser_client.post(button_url(item, "retry", "failedworkitem"), follow=True)
    assert response.redirect_chain == [(change_url(item), 302)]
    assert "1 work item(s) set to pending for a new run." in response.content.decode()


@pytest.mark.parametrize(("name", "status"), [("cancel", "cancelled"), ("run_now", "pending")])
def test_cancel_and_run_now_from_the_row_page(
    superuser_client: Client, name: str, status: str
) -> None:
    item = make_item(handler="echo")
    response = superuser_client.post(button_url(item, name), follow=True)
    text = response.content.decode()
    assert "1 work item(s)" in text
    assert WorkItem.objects.get(pk=item.pk).status == status


def test_a_button_for_a_state_the_row_left_changes_nothing_and_says_so(
    superuser_client: Client,
) -> None:
    item = make_item(handler="echo", status=Status.SUCCEEDED)
    response = superuser_client.post(button_url(item, "retry"), follow=True)
    text = response.content.decode()
    assert "0 work item(s) set to pending" in text and "1 skipped" in text
    assert WorkItem.objects.get(pk=item.pk).status == Status.SUCCEEDED


def test_the_row_actions_need_post_the_change_permission_and_the_csrf_token(
    viewer_client: Client,
) -> None:
    item = make_item(handler="echo", status=Status.FAILED)
    operator = User.objects.create_user("operator", password="pw", is_staff=True)
    operator.user_permissions.add(
        Permission.objects.get(
            content_type__app_label="django_dbworker", codename="change_workitem"
        )
    )
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(operator)
    assert viewer_client.post(button_url(item, "retry")).status_code == 403
    assert strict.post(button_url(item, "retry")).status_code == 403  # no CSRF token
    loose = Client()
    loose.force_login(operator)
    assert loose.get(button_url(item, "retry")).status_code == 405
    assert loose.post(button_url(item, "delete")).status_code == 404
    assert WorkItem.objects.get(pk=item.pk).status == Status.FAILED
    assert loose.post(button_url(item, "retry")).status_code == 302
    assert WorkItem.objects.get(pk=item.pk).status == Status.PENDING


def test_a_row_action_on_a_row_of_another_page_is_not_found(superuser_client: Client) -> None:
    pending = make_item(handler="echo")
    response = superuser_client.post(button_url(pending, "retry", "failedworkitem"))
    assert response.status_code == 404


def test_a_rows_page_has_no_empty_history_button(superuser_client: Client) -> None:
    """Django's "History" lists admin edits, and a work item has none (its story is its
    status, attempts and error history, on the page): the button would open an empty
    page, so the row page leaves it out."""
    item = make_item(status=Status.FAILED)
    html = superuser_client.get(change_url(item)).content.decode()
    assert 'class="historylink"' not in html
    assert "/history/" not in html
