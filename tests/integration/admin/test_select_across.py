"""Actions on every row matching a list's filter ("Select all"): a confirmation, then batches."""

from __future__ import annotations

import re
from urllib.parse import urlencode

import pytest
from django.test import Client
from django.urls import reverse

from django_dbworker.admin import actions
from django_dbworker.models import Status, WorkItem
from tests.factories import make_item

pytestmark = pytest.mark.django_db

LIST = "admin:django_dbworker_workitem_changelist"
FAILED_LIST = "admin:django_dbworker_failedworkitem_changelist"


def _select_all(client: Client, url: str, action: str, one_pk: int) -> str:
    """What the list's "Select all N" then Go sends: the page's checked rows and select_across."""
    response = client.post(
        url, {"action": action, "select_across": "1", "index": "0", "_selected_action": [one_pk]}
    )
    assert response.status_code == 200, response.status_code
    return response.content.decode()


def _form_fields(html: str) -> list[tuple[str, str]]:
    """The hidden fields of the confirmation page's form, as the browser would send them."""
    form = html.split('<div id="dbw-confirm">')[1].split("</form>")[0]
    return re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', form)


def _confirm(client: Client, url: str, html: str) -> Client:
    data: dict[str, list[str]] = {}
    for name, value in _form_fields(html):
        data.setdefault(name, []).append(value)
    return client.post(url, data)


def _bulk(n: int, **fields: object) -> None:
    WorkItem.objects.bulk_create(
        WorkItem(handler="echo", payload={}, max_attempts=3, **fields) for _ in range(n)
    )


def _cell(html: str, cell: str) -> str:
    match = re.search(rf'id="dbw-confirm-{cell}">([^<]*)<', html)
    assert match, cell
    return match.group(1)


def test_select_all_asks_first_with_the_filter_and_counts(superuser_client: Client) -> None:
    _bulk(4, queue="q1", status=Status.FAILED, attempts=3)
    _bulk(2, queue="q1", status=Status.SUCCEEDED)
    _bulk(3, queue="q2", status=Status.FAILED, attempts=3)
    first = WorkItem.objects.filter(queue="q1").first()
    assert first is not None
    url = reverse(LIST) + "?queue=q1"
    html = _select_all(superuser_client, url, "retry", first.pk)
    assert "queue = <code>q1</code>" in html
    assert (_cell(html, "matching"), _cell(html, "eligible")) == ("6", "4")
    assert 'name="csrfmiddlewaretoken"' in html
    # Nothing changed yet.
    assert WorkItem.objects.filter(status=Status.FAILED).count() == 7


def test_confirmed_it_changes_every_matching_row_in_batches(
    superuser_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(actions, "BATCH_SIZE", 3)
    _bulk(8, queue="q1", status=Status.FAILED, attempts=3)
    _bulk(2, queue="q1", status=Status.SUCCEEDED)
    _bulk(3, queue="q2", status=Status.FAILED, attempts=3)
    one = WorkItem.objects.filter(queue="q1").first()
    assert one is not None
    url = reverse(LIST) + "?queue=q1"
    html = _select_all(superuser_client, url, "retry", one.pk)
    response = _confirm(superuser_client, url, html)
    assert response.status_code == 302 and response["Location"] == url
    page = superuser_client.get(url).content.decode()
    assert "8 work item(s) set to pending for a new run." in page
    assert WorkItem.objects.filter(queue="q1", status=Status.PENDING, attempts=0).count() == 8
    assert WorkItem.objects.filter(queue="q1", status=Status.SUCCEEDED).count() == 2
    assert WorkItem.objects.filter(queue="q2", status=Status.FAILED).count() == 3


def test_select_all_over_a_payload_search_changes_only_the_rows_it_found(
    superuser_client: Client,
) -> None:
    """The search is part of the filter: the rows whose payload matches, and never a
    sensitive handler's row with the same payload, which the search leaves out."""
    for handler in ("echo", "secret"):
        WorkItem.objects.bulk_create(
            WorkItem(handler=handler, payload={"order": order}, max_attempts=3)
            for order in (7, 7, 8)
        )
    one = WorkItem.objects.filter(handler="echo", payload__order=7).first()
    assert one is not None
    url = reverse(LIST) + "?" + urlencode({"q": "payload.order=7"})
    html = _select_all(superuser_client, url, "cancel", one.pk)
    assert _cell(html, "matching") == "2"
    response = _confirm(superuser_client, url, html)
    assert response.status_code == 302
    cancelled = WorkItem.objects.filter(status=Status.CANCELLED)
    assert sorted(cancelled.values_list("handler", "payload__order")) == [("echo", 7)] * 2


def test_a_capped_selection_changes_every_row_not_only_the_first_10000(
    superuser_client: Client,
) -> None:
    _bulk(10_050, queue="big", status=Status.FAILED, attempts=3)
    _bulk(5, queue="other", status=Status.FAILED, attempts=3)
    one = WorkItem.objects.filter(queue="big").first()
    assert one is not None
    url = reverse(FAILED_LIST) + "?queue=big"
    html = _select_all(superuser_client, url, "retry", one.pk)
    assert (_cell(html, "matching"), _cell(html, "eligible")) == ("at least 10,000",) * 2
    response = _confirm(superuser_client, url, html)
    assert response.status_code == 302
    assert WorkItem.objects.filter(queue="big", status=Status.PENDING).count() == 10_050
    assert WorkItem.objects.filter(queue="other", status=Status.FAILED).count() == 5
    page = superuser_client.get(reverse(LIST)).content.decode()
    assert "10050 work item(s) set to pending" in page


def test_a_run_that_stops_for_time_goes_on_where_it_stopped(
    superuser_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(actions, "BATCH_SIZE", 2)
    monkeypatch.setattr(actions, "ACROSS_SECONDS", 0.0)
    _bulk(5, status=Status.PENDING)
    make_item(handler="echo", status=Status.SUCCEEDED)
    one = WorkItem.objects.first()
    assert one is not None
    url = reverse(LIST) + "?status__exact=pending"
    html = _select_all(superuser_client, url, "run_now", one.pk)
    assert _cell(html, "eligible") == "5"
    pages = 0
    response = _confirm(superuser_client, url, html)
    while response.status_code == 200:  # a page that offers to go on
        pages += 1
        assert pages < 5
        html = response.content.decode()
        assert "So far <strong>" in html
        response = _confirm(superuser_client, url, html)
    assert pages == 2  # 2 + 2 rows, then the last one ends the run
    assert response.status_code == 302
    # Run now leaves the rows pending (still matching): the cursor took each once.
    page = superuser_client.get(url).content.decode()
    assert "5 work item(s) made due now." in page


def test_cancel_over_a_filter_leaves_rows_in_other_states_alone(
    superuser_client: Client,
) -> None:
    _bulk(3, queue="q1")
    _bulk(2, queue="q1", status=Status.FAILED, attempts=3)
    one = WorkItem.objects.filter(queue="q1").first()
    assert one is not None
    url = reverse(LIST) + "?queue=q1"
    html = _select_all(superuser_client, url, "cancel", one.pk)
    assert (_cell(html, "matching"), _cell(html, "eligible")) == ("5", "3")
    assert _confirm(superuser_client, url, html).status_code == 302
    assert WorkItem.objects.filter(queue="q1", status=Status.CANCELLED).count() == 3
    assert WorkItem.objects.filter(queue="q1", status=Status.FAILED).count() == 2


def test_nothing_to_change_offers_no_button(superuser_client: Client) -> None:
    _bulk(3, status=Status.SUCCEEDED)
    one = WorkItem.objects.first()
    assert one is not None
    html = _select_all(superuser_client, reverse(LIST), "retry", one.pk)
    assert "Nothing to change." in html and 'id="dbw-confirm-yes"' not in html


def test_view_only_staff_cannot_act_across_a_filter(viewer_client: Client) -> None:
    _bulk(3, status=Status.FAILED, attempts=3)
    one = WorkItem.objects.first()
    assert one is not None
    viewer_client.post(
        reverse(LIST),
        {"action": "retry", "select_across": "1", "post": "yes", "_selected_action": [one.pk]},
    )
    assert WorkItem.objects.filter(status=Status.FAILED).count() == 3


def test_a_selection_without_select_all_still_applies_at_once(superuser_client: Client) -> None:
    a = make_item(handler="echo", status=Status.FAILED, attempts=3)
    make_item(handler="echo", status=Status.FAILED, attempts=3)
    response = superuser_client.post(
        reverse(LIST),
        {"action": "retry", "select_across": "0", "index": "0", "_selected_action": [a.pk]},
    )
    assert response.status_code == 302
    assert WorkItem.objects.filter(status=Status.FAILED).count() == 1


@pytest.mark.server_db
@pytest.mark.django_db(transaction=True)
def test_each_batch_commits_on_its_own_while_a_locked_row_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A row a worker holds locked stalls only its own batch; the batches before it are done.

    Batches go newest first; the oldest row is locked by another connection
    (as a claim or a heartbeat holds it), so the last batch waits for it
    while the two before it are already committed and visible.
    """
    import threading

    from django.db import connection, transaction

    from tests.conftest import wait_until

    monkeypatch.setattr(actions, "BATCH_SIZE", 2)
    _bulk(6, status=Status.FAILED, attempts=3)
    ids = sorted(WorkItem.objects.values_list("pk", flat=True))
    locked, release = threading.Event(), threading.Event()
    outcome: list[actions.BatchRun] = []

    def hold_the_oldest_row() -> None:
        try:
            with transaction.atomic():
                list(WorkItem.objects.select_for_update().filter(pk=ids[0]))
                locked.set()
                release.wait(30)
        finally:
            connection.close()

    def retry_all() -> None:
        try:
            outcome.append(
                actions.run_in_batches(actions.RETRY, WorkItem.objects.filter(status=Status.FAILED))
            )
        finally:
            connection.close()

    holder = threading.Thread(target=hold_the_oldest_row)
    holder.start()
    assert locked.wait(10)
    runner = threading.Thread(target=retry_all)
    runner.start()
    try:
        wait_until(
            lambda: WorkItem.objects.filter(pk__in=ids[2:], status=Status.PENDING).count() == 4,
            what="the first two batches to commit",
        )
        assert runner.is_alive()  # the last batch waits for the locked row
        assert WorkItem.objects.filter(pk__in=ids[:2], status=Status.FAILED).count() == 2
    finally:
        release.set()
        holder.join(10)
        runner.join(30)
    assert outcome == [actions.BatchRun(changed=6, read=6, before=None)]
    assert WorkItem.objects.filter(status=Status.PENDING).count() == 6
