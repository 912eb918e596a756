"""The admin of batches and dependencies: the Batches page, the Work items batch filter,
waiting rows, and a row's batch, parents and dependents."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from django_dbworker import batch
from django_dbworker.batches.models import Batch, Dependency
from django_dbworker.models import Status, WorkItem
from django_dbworker.testing import run_until_empty
from tests.factories import claim
from tests.testapp.workers import BatchDone, Echo, Noop, NoRetry, Record

pytestmark = pytest.mark.django_db

BATCHES = "admin:django_dbworker_batch_changelist"
ITEMS = "admin:django_dbworker_workitem_changelist"


def _batch_url(pk: int) -> str:
    return reverse("admin:django_dbworker_batch_change", args=[pk])


def _row_url(pk: int) -> str:
    return reverse("admin:django_dbworker_workitem_change", args=[pk])


def _html(client: Client, url: str) -> str:
    response = client.get(url)
    assert response.status_code == 200, url
    return response.content.decode()


def _row(html: str, pk: int) -> str:
    """The list row of batch ``pk``."""
    match = re.search(rf"<tr[^>]*>(?:(?!</tr>).)*?/batch/{pk}/change/.*?</tr>", html, re.S)
    assert match, pk
    return match.group(0)


def _user(*codenames: str) -> Client:
    user = User.objects.create_user("u-" + "-".join(codenames), password="pw", is_staff=True)
    for codename in codenames:
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="django_dbworker", codename=codename)
        )
    client = Client()
    client.force_login(user)
    return client


def completed_with_a_failure() -> Batch:
    """Three items succeeded and one failed: complete, its callback enqueued."""
    with batch(on_complete=BatchDone, payload={"import_id": 7}) as b:
        Noop.enqueue_many([{}, {}, {}])
        NoRetry.enqueue({"key": "x"})
    run_until_empty([Noop, NoRetry])
    return Batch.objects.get(pk=b.pk)


def in_progress() -> Batch:
    """Two of five items succeeded, one is running, two are pending."""
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue_many([{}, {}])
        Echo.enqueue_many([{"n": 1}, {"n": 2}, {"n": 3}])
    run_until_empty([Noop])
    assert len(claim(limit=1, handlers=["echo"])) == 1
    return Batch.objects.get(pk=b.pk)


# -- the Batches page -------------------------------------------------------------


def test_anonymous_users_are_sent_to_login(client: Client) -> None:
    response = client.get(reverse(BATCHES))
    assert response.status_code == 302 and "/login/" in response["Location"]


def test_staff_without_permission_is_forbidden(staff_client: Client) -> None:
    b = completed_with_a_failure()
    assert staff_client.get(reverse(BATCHES)).status_code == 403
    assert staff_client.get(_batch_url(b.pk)).status_code == 403
    assert "Batches" not in _html(staff_client, reverse("admin:index"))


@pytest.mark.parametrize("codename", ["view_workitem", "change_workitem", "view_batch"])
def test_the_page_opens_with_the_view_permission_of_work_items_or_batches(
    codename: str,
) -> None:
    b = completed_with_a_failure()
    client = _user(codename)
    html = _html(client, reverse(BATCHES))
    assert f"/batch/{b.pk}/change/" in html
    assert 'name="action"' not in html  # read-only: no actions
    assert _html(client, _batch_url(b.pk))
    index = _html(client, reverse("admin:app_list", args=["django_dbworker"]))
    assert "Batches" in index


def test_batches_are_read_only_for_everyone(superuser_client: Client) -> None:
    b = completed_with_a_failure()
    html = _html(superuser_client, _batch_url(b.pk))
    assert 'name="_save"' not in html and "Delete" not in html
    assert superuser_client.get(reverse("admin:django_dbworker_batch_add")).status_code == 403
    response = superuser_client.post(_batch_url(b.pk), {"on_complete": "echo"})
    assert response.status_code == 403
    assert Batch.objects.get(pk=b.pk).on_complete == "batch_done"


def test_the_list_shows_progress_state_and_callback(superuser_client: Client) -> None:
    done = completed_with_a_failure()
    running = in_progress()
    html = _html(superuser_client, reverse(BATCHES))
    row = _row(html, done.pk)
    assert "batch_done" in row and "completed" in row
    for words in ("<strong>4</strong> items", "3 succeeded", "1 failed", "0 cancelled"):
        assert words in row, words
    assert done.callback_id is not None
    assert f'href="{_row_url(done.callback_id)}"' in row
    assert "dbw-seg-succeeded" in row and "dbw-seg-failed" in row
    row = _row(html, running.pk)
    assert "open" in row and running.callback_id is None
    for words in ("<strong>5</strong> items", "2 succeeded", "0 failed", "3 pending (1 running)"):
        assert words in row, words
    assert "dbw-seg-claimed" in row and "dbw-seg-queued" in row
    # Widths of the bar: 2 of 5 succeeded, 1 running, 2 pending.
    assert "width:40.00%" in row and "width:20.00%" in row


def test_the_state_filter_and_the_search(superuser_client: Client) -> None:
    done = completed_with_a_failure()
    running = in_progress()
    url = reverse(BATCHES)
    opened = _html(superuser_client, url + "?state=open")
    assert f"/batch/{running.pk}/change/" in opened and f"/batch/{done.pk}/change/" not in opened
    completed = _html(superuser_client, url + "?state=completed")
    assert f"/batch/{done.pk}/change/" in completed
    assert f"/batch/{running.pk}/change/" not in completed
    found = _html(superuser_client, url + f"?q={done.pk}")
    assert f"/batch/{done.pk}/change/" in found and f"/batch/{running.pk}/change/" not in found
    assert f"/batch/{done.pk}/change/" not in _html(superuser_client, url + "?q=batch_done")


@pytest.mark.parametrize(
    "lookup", ["payload__secret__startswith=h", "on_complete__startswith=b", "total__gt=1"]
)
def test_the_list_refuses_lookups_that_no_filter_uses(viewer_client: Client, lookup: str) -> None:
    completed_with_a_failure()
    assert viewer_client.get(f"{reverse(BATCHES)}?{lookup}").status_code == 400


def _queries(client: Client, url: str) -> int:
    with CaptureQueriesContext(connection) as ctx:
        assert client.get(url).status_code == 200
    return len(ctx.captured_queries)


#: Session, user, the count, the rows, their progress, their callbacks' states.
LIST_BUDGET = 6


def test_the_list_costs_the_same_queries_for_one_batch_or_a_page(superuser_client: Client) -> None:
    completed_with_a_failure()
    small = _queries(superuser_client, reverse(BATCHES))
    for n in range(12):
        with batch(on_complete=BatchDone):
            Noop.enqueue_many([{}] * (n % 4))
    completed_with_a_failure()
    in_progress()
    big = _queries(superuser_client, reverse(BATCHES))
    assert big == small <= LIST_BUDGET


def test_progress_of_open_batches_is_one_grouped_query(superuser_client: Client) -> None:
    for _ in range(3):
        in_progress()
    with CaptureQueriesContext(connection) as ctx:
        _html(superuser_client, reverse(BATCHES))
    grouped = [q["sql"] for q in ctx.captured_queries if "GROUP BY" in q["sql"].upper()]
    assert len(grouped) == 1, grouped


def test_the_change_page_shows_progress_items_and_callback(superuser_client: Client) -> None:
    done = completed_with_a_failure()
    html = _html(superuser_client, _batch_url(done.pk))
    assert "3 succeeded" in html and "1 failed" in html
    assert f"?batch={done.pk}" in html
    assert f'href="{_row_url(done.callback_id or 0)}"' in html
    assert "import_id" in html  # the callback's payload


def test_a_pruned_callback_shows_a_dash(superuser_client: Client) -> None:
    done = completed_with_a_failure()
    WorkItem.objects.filter(pk=done.callback_id).delete()
    row = _row(_html(superuser_client, reverse(BATCHES)), done.pk)
    assert "—" in row and f'href="{_row_url(done.callback_id or 0)}"' not in row
    assert "—" in _html(superuser_client, _batch_url(done.pk))


def test_a_retry_after_completion_shows_beside_the_stored_counts(superuser_client: Client) -> None:
    done = completed_with_a_failure()
    failed = WorkItem.objects.get(batch_id=done.pk, status=Status.FAILED)
    WorkItem.objects.filter(pk=failed.pk).retry()
    row = _row(_html(superuser_client, reverse(BATCHES)), done.pk)
    # The callback's counts stay; the item running again is said apart.
    assert "1 failed" in row and "1 retried since" in row and "completed" in row


def test_the_callback_payload_of_an_unregistered_handler_is_redacted(
    superuser_client: Client,
) -> None:
    b = Batch.objects.create(on_complete="gone_handler", payload={"token": "s3cret"})
    html = _html(superuser_client, _batch_url(b.pk))
    assert "s3cret" not in html and "redacted" in html


# -- the Work items page: by batch, waiting rows ------------------------------------


def test_the_items_link_filters_the_work_items_by_batch(
    superuser_client: Client, viewer_client: Client
) -> None:
    done = completed_with_a_failure()
    running = in_progress()
    items = set(WorkItem.objects.filter(batch_id=done.pk).values_list("pk", flat=True))
    assert len(items) == 4
    url = f"{reverse(ITEMS)}?batch={done.pk}"
    assert url in _html(superuser_client, reverse(BATCHES)).replace("&amp;", "&")
    for client in (superuser_client, viewer_client):
        html = _html(client, url)
        shown = {int(pk) for pk in re.findall(r"/workitem/(\d+)/change/", html)}
        assert shown == items
        assert f"#{done.pk}" in html  # the filter says which batch
    other = _html(superuser_client, f"{reverse(ITEMS)}?batch={running.pk}&status__exact=pending")
    assert {int(pk) for pk in re.findall(r"/workitem/(\d+)/change/", other)} == set(
        WorkItem.objects.filter(batch_id=running.pk, status=Status.PENDING).values_list(
            "pk", flat=True
        )
    )


@pytest.mark.parametrize("value", ["abc", "²", "99999999999999999999", "-1"])
def test_a_bad_batch_value_lists_nothing(superuser_client: Client, value: str) -> None:
    completed_with_a_failure()
    html = _html(superuser_client, f"{reverse(ITEMS)}?batch={value}")
    assert not re.findall(r"/workitem/(\d+)/change/", html)


def test_waiting_rows_are_marked_and_filtered(superuser_client: Client) -> None:
    a = Record.enqueue({"key": "a"})
    b = Record.enqueue({"key": "b"}, after=[a])
    html = _html(superuser_client, reverse(ITEMS))
    assert html.count('class="dbw-waiting"') == 1
    assert "after its parents" in html
    waiting = _html(superuser_client, f"{reverse(ITEMS)}?waiting=yes")
    assert {int(pk) for pk in re.findall(r"/workitem/(\d+)/change/", waiting)} == {b.pk}


def test_a_waiting_row_offers_no_run_now_button(superuser_client: Client) -> None:
    a = Record.enqueue({"key": "a"})
    b = Record.enqueue({"key": "b"}, after=[a])
    assert 'value="run_now"' in _html(superuser_client, _row_url(a.pk))
    html = _html(superuser_client, _row_url(b.pk))
    assert 'value="run_now"' not in html and 'value="cancel"' in html


# -- a row's page: batch, parents, dependents ----------------------------------------


def test_a_rows_page_shows_its_batch_parents_and_dependents(superuser_client: Client) -> None:
    a = Record.enqueue({"key": "a"})
    other = Record.enqueue({"key": "o"})
    with batch(on_complete=BatchDone) as b:
        t = Record.enqueue({"key": "t"}, after=[a, other])
    load = Record.enqueue({"key": "l"}, after=[t])
    html = _html(superuser_client, _row_url(t.pk))
    assert "Batch and dependencies" in html
    assert f'href="{_batch_url(b.pk)}"' in html and "<strong>1</strong> item" in html
    assert f'href="{_row_url(a.pk)}"' in html and f'href="{_row_url(other.pk)}"' in html
    assert f'href="{_row_url(load.pk)}"' in html
    assert "Waiting: it is claimed once every one of these has succeeded" in html
    assert "9999-" not in html  # its run_after (year 9999) says "after its parents"
    parents = html[html.index("Runs after") : html.index("Runs before")]
    assert parents.count("dbw-status dbw-pending") == 2
    # A row without batch or links has no such fieldset.
    plain = Noop.enqueue({})
    assert "Batch and dependencies" not in _html(superuser_client, _row_url(plain.pk))


def test_a_rows_page_shows_gone_parents_and_batches(superuser_client: Client) -> None:
    a = Record.enqueue({"key": "a"})
    with batch(on_complete=BatchDone) as b:
        child = Record.enqueue({"key": "c"}, after=[a])
    WorkItem.objects.filter(pk=a.pk).delete()
    Batch.objects.filter(pk=b.pk).delete()
    html = _html(superuser_client, _row_url(child.pk))
    assert f"#{a.pk} (gone)" in html and f"#{b.pk} (gone)" in html


def test_the_statuses_of_parents_and_dependents_are_shown(superuser_client: Client) -> None:
    a = NoRetry.enqueue({"key": "a"})
    b = Record.enqueue({"key": "b"}, after=[a])
    run_until_empty([NoRetry])
    html = _html(superuser_client, _row_url(a.pk))
    dependents = html[html.index("Runs before") :]
    assert f'href="{_row_url(b.pk)}"' in dependents and "dbw-status dbw-cancelled" in dependents
    html = _html(superuser_client, _row_url(b.pk))
    parents = html[html.index("Runs after") :]
    assert f'href="{_row_url(a.pk)}"' in parents and "dbw-status dbw-failed" in parents


def test_a_rows_page_costs_the_same_queries_for_3_or_60_dependents(
    superuser_client: Client,
) -> None:
    few = Record.enqueue({"key": "few"})
    for _ in range(3):
        Record.enqueue({}, after=[few])
    many = Record.enqueue({"key": "many"})
    with batch(on_complete=BatchDone):
        for _ in range(60):
            Record.enqueue({}, after=[many])
    assert Dependency.objects.filter(parent=many).count() == 60
    small = _queries(superuser_client, _row_url(few.pk))
    big = _queries(superuser_client, _row_url(many.pk))
    # 60 dependents: the first 50 listed, one count for the rest.
    assert big <= small + 1
    html = _html(superuser_client, _row_url(many.pk))
    assert "… and 10 more" in html
    child = Dependency.objects.filter(parent=many).order_by("-child_id")[0].child_id
    # A child: its batch (row, progress), its parent; no N+1 either way.
    assert _queries(superuser_client, _row_url(child)) <= small + 2


def test_every_link_of_the_batch_pages_works_for_viewers(
    superuser_client: Client, viewer_client: Client
) -> None:
    """Filters, sorting, the items links, the callback and row links: none is refused."""
    import html as html_lib

    done = completed_with_a_failure()
    running = in_progress()
    a = Record.enqueue({"key": "a"})
    with batch(on_complete=BatchDone):
        child = Record.enqueue({"key": "c"}, after=[a])
    start = [
        reverse(BATCHES),
        reverse(BATCHES) + "?state=open",
        _batch_url(done.pk),
        _batch_url(running.pk),
        _row_url(child.pk),
        _row_url(a.pk),
    ]
    links: set[str] = set()
    for url in start:
        page = _html(superuser_client, url)
        for link in re.findall(r'href="((?:/admin/django_dbworker/[^"#?]*)?\?[^"#]*)"', page):
            link = html_lib.unescape(link)
            links.add(url.split("?")[0] + link if link.startswith("?") else link)
        links |= set(
            re.findall(r'href="(/admin/django_dbworker/(?:batch|workitem)/\d+/change/)"', page)
        )
    for expected in ("state=", "o=", "batch=", "/workitem/", "/batch/"):
        assert any(expected in link for link in links), expected
    for link in sorted(links):
        for client in (superuser_client, viewer_client):
            assert client.get(link).status_code == 200, link


def test_retry_every_failed_item_of_a_batch_with_select_all(superuser_client: Client) -> None:
    """An operator's retry after the batch completed: the batch stays complete, no 2nd callback."""
    from tests.integration.admin.test_select_across import _confirm, _select_all

    done = completed_with_a_failure()
    other = completed_with_a_failure()
    url = f"{reverse(ITEMS)}?batch={done.pk}&status__exact=failed"
    failed = WorkItem.objects.get(batch_id=done.pk, status=Status.FAILED)
    html = _select_all(superuser_client, url, "retry", failed.pk)
    assert 'id="dbw-confirm"' in html
    _confirm(superuser_client, url, html)
    assert WorkItem.objects.get(pk=failed.pk).status == Status.PENDING
    assert WorkItem.objects.filter(batch_id=other.pk, status=Status.FAILED).count() == 1
    run_until_empty([NoRetry])
    assert WorkItem.objects.filter(handler="batch_done", payload__batch=done.pk).count() == 1
    row = _row(_html(superuser_client, reverse(BATCHES)), done.pk)
    assert "1 failed" in row and "retried since" not in row
