"""The admin's security properties: what a user may filter on, see and do.

- Lists accept only the lookups of their own filters and links: any other
  is refused (400), so a list is no oracle for payloads, results or errors
  the user may not read.
- Pretty-printed values are bounded in size and depth; the raw JSON is a
  download with the change page's permission and redaction rules.
- Every page and action follows the permissions of ``WorkItem``, not those
  of the proxy model a page is registered for.
- ``sensitive`` covers results as it covers payloads.

Actions are posted through a client that enforces CSRF, as a browser's would be.
"""

from __future__ import annotations

import html as html_lib
import json
import re
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.http import HttpResponse
from django.test import Client
from django.urls import reverse

from django_dbworker.fleet.models import LiveWorker
from django_dbworker.models import Status, WorkItem
from django_dbworker.worker.scheduler import ensure_schedules
from tests.factories import age_heartbeat, claim, make_item

pytestmark = pytest.mark.django_db

LISTS = {
    "workitem": "admin:django_dbworker_workitem_changelist",
    "claimedworkitem": "admin:django_dbworker_claimedworkitem_changelist",
    "failedworkitem": "admin:django_dbworker_failedworkitem_changelist",
}
SUMMARY = "admin:django_dbworker_queuesummary_changelist"
SCHEDULES = "admin:django_dbworker_periodicschedule_changelist"
WORKERS = "admin:django_dbworker_liveworker_changelist"
SECRET = "hunter2"


def _user(username: str, *codenames: str) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    for codename in codenames:
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="django_dbworker", codename=codename)
        )
    return user


def _csrf_client(user: User) -> Client:
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    return client


def _post_action(
    client: Client, url: str, action: str, ids: list[int], **extra: Any
) -> HttpResponse:
    """POST an action as the changelist's form does, with the CSRF token of a real page."""
    client.get(reverse("admin:index"))  # every admin page carries a token (logout form)
    token = client.cookies["csrftoken"].value
    data = {"action": action, "_selected_action": ids, "csrfmiddlewaretoken": token, **extra}
    response: HttpResponse = client.post(url, data)
    return response


def _ids(html: str) -> set[int]:
    return {int(m) for m in re.findall(r'name="_selected_action" value="(\d+)"', html)} | {
        int(m) for m in re.findall(r"/(?:claimed|failed)?workitem/(\d+)/change/", html)
    }


@pytest.fixture
def secret_rows() -> dict[str, WorkItem]:
    """One row of the sensitive handler in each list, each holding the secret everywhere."""
    fields = {
        "payload": {"password": SECRET},
        "result": {"token": SECRET},
        "last_error": f"ValueError: {SECRET}",
        "error_history": [{"attempt": 1, "error": f"ValueError: {SECRET}"}],
        "trace_context": {"traceparent": f"00-{SECRET}"},
    }
    failed = make_item(handler="secret", status=Status.FAILED, attempts=1, **fields)
    make_item(handler="secret", **fields)
    (claimed,) = claim(limit=1, handlers=["secret"])
    WorkItem.objects.filter(pk=claimed.pk).update(**fields)
    return {"failed": failed, "claimed": claimed}


# -- (1) the lists are no oracle for hidden values ---------------------------------

HOSTILE_LOOKUPS = [
    f"payload__password__startswith={SECRET[0]}",
    f"payload__password={SECRET}",
    "payload__icontains=hunt",
    "payload__has_key=password",
    f"result__token__startswith={SECRET[0]}",
    "result__isnull=False",
    "last_error__startswith=ValueError: h",
    "last_error__icontains=hunt",
    "error_history__0__error__startswith=ValueError: h",
    f"trace_context__traceparent__startswith=00-{SECRET[0]}",
    # Not secret, but no filter or link of the page uses them either.
    "priority__gt=0",
    "handler__startswith=sec",
    "claimed_by__contains=test",
    "unique_key__isnull=True",
]


@pytest.mark.parametrize("lookup", HOSTILE_LOOKUPS)
@pytest.mark.parametrize("page", sorted(LISTS))
def test_lists_refuse_lookups_that_no_filter_or_link_uses(
    viewer_client: Client, secret_rows: dict[str, WorkItem], page: str, lookup: str
) -> None:
    response = viewer_client.get(f"{reverse(LISTS[page])}?{lookup}")
    assert response.status_code == 400
    assert SECRET not in response.content.decode()


@pytest.mark.parametrize("name", [SUMMARY, SCHEDULES, WORKERS])
def test_pages_without_parameters_refuse_lookups_too(
    viewer_client: Client, secret_rows: dict[str, WorkItem], name: str
) -> None:
    for lookup in HOSTILE_LOOKUPS[:3]:
        assert viewer_client.get(f"{reverse(name)}?{lookup}").status_code == 400, lookup
    assert viewer_client.get(reverse(name)).status_code == 200


def test_an_action_on_a_hostile_selection_is_refused(secret_rows: dict[str, WorkItem]) -> None:
    client = _csrf_client(_user("operator", "change_workitem"))
    url = f"{reverse(LISTS['workitem'])}?payload__password__startswith={SECRET[0]}"
    response = _post_action(client, url, "cancel", [0], select_across="1", index="0")
    assert response.status_code == 400
    assert not WorkItem.objects.filter(status=Status.CANCELLED).exists()


def _admin_links(html: str, page: str) -> set[str]:
    """Every link to one of this app's admin pages that carries a query string.

    Filters, sorting and paging link with a bare query string (``?o=2``), the
    dashboard and the schedules with a path.
    """
    path = page.split("?")[0]
    links = re.findall(r'href="((?:/admin/django_dbworker/[^"#?]*)?\?[^"#]*)"', html)
    return {html_lib.unescape(path + link if link.startswith("?") else link) for link in links}


def test_every_link_the_admin_renders_still_works(
    superuser_client: Client, viewer_client: Client
) -> None:
    """Filters, sorting, paging, the dashboard's and the schedules' links: none is refused."""
    from django.db.models.functions import Now

    for n in range(55):  # more than a page of rows: paging links
        make_item(handler="echo", queue=f"q{n % 3}")
    failed = make_item(
        handler="noop",
        queue="q1",
        status=Status.FAILED,
        attempts=3,
        finished_at=Now(),
        last_error="ValueError: broke",
    )
    make_item(handler="echo", status=Status.SUCCEEDED, finished_at=Now(), claimed_at=Now())
    make_item(handler="gone-handler")  # an orphan, linked from the dashboard
    make_item(handler="noop", queue="q2", unique_key="k")
    (claimed,) = claim(limit=1, handlers=["noop"])
    age_heartbeat(claimed, 3600)  # a stale claim
    ensure_schedules(["nightly"], using="default")
    LiveWorker.objects.create(name=claimed.claimed_by.rpartition(":")[0], handlers=["noop"])

    start = [
        *(reverse(name) for name in LISTS.values()),
        f"{reverse(LISTS['workitem'])}?status__exact=failed&queue=q1&handler=noop",
        f"{reverse(LISTS['failedworkitem'])}?queue=q1&handler=noop",
        reverse(SUMMARY),
        reverse(SCHEDULES),
        reverse(WORKERS),
        reverse("admin:django_dbworker_workitem_change", args=[failed.pk]),
        reverse("admin:django_dbworker_failedworkitem_change", args=[failed.pk]),
    ]
    links: set[str] = set()
    for url in start:
        response = superuser_client.get(url)
        assert response.status_code == 200, url
        links |= _admin_links(response.content.decode(), url)
    # Each kind of link is there: filters, sorting, paging, the dashboard's.
    for expected in ("status__exact=", "queue=", "handler=", "o=", "p=", "worker="):
        assert any(expected in link for link in links), expected
    assert any("failedworkitem/?" in link for link in links)
    for link in sorted(links):
        for client in (superuser_client, viewer_client):
            response = client.get(link)
            # 200, not a refusal (400) nor Django's "?e=1" redirect for bad lookups.
            assert response.status_code == 200, link


def test_search_still_finds_by_id_handler_and_unique_key(viewer_client: Client) -> None:
    item = make_item(handler="echo", unique_key="invoice:7")
    url = reverse(LISTS["workitem"])
    for term in (str(item.pk), "echo", "invoice:7"):
        response = viewer_client.get(url, {"q": term})
        assert response.status_code == 200 and item.pk in _ids(response.content.decode())


@pytest.mark.parametrize(
    "term",
    [
        f"payload.password={SECRET}",
        f'payload.password="{SECRET}"',
        json.dumps({"password": SECRET}),
        "payload.password=null",
        '{"password": {"x": 1}}',
    ],
)
@pytest.mark.parametrize("page", sorted(LISTS))
def test_payload_search_never_answers_for_a_redacted_payload(
    viewer_client: Client, superuser_client: Client, secret_rows: dict, page: str, term: str
) -> None:
    """A sensitive or unregistered handler's rows are left out of every payload search
    before its payload is compared, so the list is no yes/no oracle for a value the change
    page redacts; a shown handler's row with the same payload is found."""
    shown = make_item(handler="echo", payload={"password": SECRET})
    make_item(handler="gone-handler", payload={"password": SECRET})
    hidden = set(WorkItem.objects.exclude(handler="echo").values_list("pk", flat=True))
    for client in (viewer_client, superuser_client):
        response = client.get(reverse(LISTS[page]), {"q": term})
        assert response.status_code == 200
        found = _ids(response.content.decode())
        assert not found & hidden, (term, found)
        if page == "workitem" and "null" not in term and '{"x"' not in term:
            assert found == {shown.pk}, term


# -- (3) pretty-printing is bounded; the raw JSON is a download ----------------------


def _change_url(item: WorkItem, model: str = "workitem") -> str:
    return reverse(f"admin:django_dbworker_{model}_change", args=[item.pk])


def _raw_url(item: WorkItem, field: str, model: str = "workitem") -> str:
    return reverse(f"admin:django_dbworker_{model}_raw", args=[item.pk, field])


def _expanding(size: int) -> Any:
    """About ``size`` bytes of JSON that pretty-prints to ten times more.

    Most of it sits 25 levels deep (MariaDB refuses JSON deeper than 32),
    where indentation makes each short line fifty characters longer.
    """
    leaf: Any = ["</pre><script>alert(1)</script>", [1] * ((size - 1_000) // 3)]
    for _ in range(24):
        leaf = {"k": leaf}
    return leaf


def test_a_1_mib_payload_renders_a_bounded_change_page(superuser_client: Client) -> None:
    payload = _expanding(1024 * 1024)
    assert 0.9 * 2**20 < len(json.dumps(payload)) < 2**20
    item = make_item(handler="echo", payload=payload, result=payload)
    response = superuser_client.get(_change_url(item))
    assert response.status_code == 200
    page = response.content.decode()
    assert len(response.content) < 2 * 2**20
    assert "truncated" in page
    assert _raw_url(item, "payload") in page and _raw_url(item, "result") in page
    # The hostile string deep inside is cut off or escaped, never markup.
    assert "<script>alert(1)" not in page


def _skip_without_deep_json() -> None:
    if connection.vendor == "mysql":
        pytest.skip("MySQL (depth 100) and MariaDB (depth 32) refuse JSON nested 900 deep")


def test_a_payload_nested_900_deep_renders(superuser_client: Client) -> None:
    _skip_without_deep_json()
    deep: Any = "leaf"
    for _ in range(900):
        deep = [deep]
    item = make_item(handler="echo", payload=deep, result=deep, status=Status.SUCCEEDED)
    response = superuser_client.get(_change_url(item))
    assert response.status_code == 200
    page = response.content.decode()
    assert len(response.content) < 2**20
    # Levels past the indentation limit are written on one line, not dropped.
    assert "[[[[" in page and "&quot;leaf&quot;]]]]" in page


def test_a_huge_error_history_renders_a_bounded_page(superuser_client: Client) -> None:
    entry = {"attempt": 1, "worker": "h:1:MainThread", "error": "<b>E</b>" * 2_500}
    item = make_item(handler="echo", status=Status.FAILED, error_history=[entry] * 100)
    response = superuser_client.get(_change_url(item))
    assert response.status_code == 200
    assert len(response.content) < 2 * 2**20
    assert "<b>E</b>" not in response.content.decode()


def test_a_small_value_is_shown_whole_without_a_download_link(superuser_client: Client) -> None:
    item = make_item(handler="echo", payload={"visible": "yes-shown"})
    page = superuser_client.get(_change_url(item)).content.decode()
    assert "yes-shown" in page and "truncated" not in page
    assert _raw_url(item, "payload") not in page


def test_the_raw_download_returns_the_stored_json(
    superuser_client: Client, viewer_client: Client
) -> None:
    payload = _expanding(200_000)
    item = make_item(handler="echo", payload=payload, result={"r": [1, 2]})
    for client in (superuser_client, viewer_client):
        response = client.get(_raw_url(item, "payload"))
        assert response.status_code == 200
        assert response["Content-Type"].startswith("application/json")
        assert response["Content-Disposition"].startswith("attachment")
        assert response["X-Content-Type-Options"] == "nosniff"
        assert json.loads(response.content) == payload
    result = superuser_client.get(_raw_url(item, "result"))
    assert json.loads(result.content) == {"r": [1, 2]}


def test_the_raw_download_of_a_900_deep_payload_works(superuser_client: Client) -> None:
    _skip_without_deep_json()
    deep: Any = "leaf"
    for _ in range(900):
        deep = [deep]
    item = make_item(handler="echo", payload=deep)
    response = superuser_client.get(_raw_url(item, "payload"))
    assert response.status_code == 200
    assert response.content.replace(b" ", b"") == b"[" * 900 + b'"leaf"' + b"]" * 900


def test_the_raw_download_obeys_permissions(staff_client: Client, client: Client) -> None:
    item = make_item(handler="echo", payload={"visible": "x"})
    assert staff_client.get(_raw_url(item, "payload")).status_code == 403
    anonymous = client.get(_raw_url(item, "payload"))
    assert anonymous.status_code == 302 and "/login/" in anonymous["Location"]
    proxy_only = Client()
    proxy_only.force_login(_user("proxy", "view_failedworkitem", "change_failedworkitem"))
    failed = make_item(handler="echo", status=Status.FAILED, payload={"visible": "x"})
    assert proxy_only.get(_raw_url(failed, "payload", "failedworkitem")).status_code == 403


def test_the_raw_download_serves_only_payload_and_result_of_the_pages_rows(
    superuser_client: Client,
) -> None:
    item = make_item(handler="echo", payload={"visible": "x"}, last_error="E")
    for field in ("last_error", "error_history", "trace_context", "handler"):
        assert superuser_client.get(_raw_url(item, field)).status_code == 404, field
    # A pending row is not on the Failed page, so not behind its URLs either.
    assert superuser_client.get(_raw_url(item, "payload", "failedworkitem")).status_code == 404
    missing = reverse("admin:django_dbworker_workitem_raw", args=[10**12, "payload"])
    assert superuser_client.get(missing).status_code == 404


@pytest.mark.parametrize("handler", ["secret", "only-in-the-worker"])
@pytest.mark.parametrize("field", ["payload", "result"])
def test_the_raw_download_of_a_hidden_value_is_refused(
    superuser_client: Client, handler: str, field: str
) -> None:
    item = make_item(
        handler=handler, status=Status.SUCCEEDED, payload={"p": SECRET}, result={"r": SECRET}
    )
    response = superuser_client.get(_raw_url(item, field))
    assert response.status_code == 403
    assert SECRET not in response.content.decode()


# -- (4) the work item's permissions decide, on every page ---------------------------


@pytest.mark.parametrize(
    ("page", "codenames"),
    [
        ("failedworkitem", ("view_failedworkitem", "change_failedworkitem")),
        ("claimedworkitem", ("view_claimedworkitem", "change_claimedworkitem")),
        ("workitem", ("view_failedworkitem", "change_failedworkitem")),
    ],
)
def test_proxy_permissions_alone_open_no_page(page: str, codenames: tuple[str, ...]) -> None:
    client = _csrf_client(_user("proxy", *codenames))
    assert client.get(reverse(LISTS[page])).status_code == 403


@pytest.mark.parametrize("codename", ["view_queuesummary", "change_queuesummary"])
def test_proxy_permissions_alone_do_not_open_the_summary(codename: str) -> None:
    client = _csrf_client(_user("proxy", codename))
    assert client.get(reverse(SUMMARY)).status_code == 403


@pytest.mark.parametrize(
    ("codenames", "status"),
    [
        (("view_liveworker",), 200),
        (("view_workitem",), 200),
        (("change_workitem",), 200),
        (("add_liveworker", "change_liveworker", "delete_liveworker"), 403),
        ((), 403),
    ],
)
def test_the_workers_page_opens_with_a_view_permission_only(
    codenames: tuple[str, ...], status: int
) -> None:
    client = _csrf_client(_user("someone", *codenames))
    assert client.get(reverse(WORKERS)).status_code == status
    index = client.get(reverse("admin:index")).content.decode()
    assert (reverse(WORKERS) in index) == (status == 200)


def test_the_workers_page_is_read_only_for_everyone(superuser_client: Client) -> None:
    row = LiveWorker.objects.create(name="web-1:42", handlers=["echo"])
    page = superuser_client.get(reverse(WORKERS)).content.decode()
    assert "web-1" in page and "<form" not in page.split('id="content-main"')[1]
    assert superuser_client.post(reverse(WORKERS), {"action": "x"}).status_code == 405
    assert superuser_client.get(reverse("admin:django_dbworker_liveworker_add")).status_code == 403
    delete = reverse("admin:django_dbworker_liveworker_delete", args=[row.pk])
    assert superuser_client.post(delete, {"post": "yes"}).status_code == 403
    change = superuser_client.get(reverse("admin:django_dbworker_liveworker_change", args=[row.pk]))
    assert change.status_code == 302 and change["Location"] == reverse(WORKERS)
    assert LiveWorker.objects.filter(pk=row.pk).exists()


def test_the_change_permission_of_failed_work_items_alone_gives_no_retry() -> None:
    failed = make_item(handler="echo", status=Status.FAILED, attempts=3)
    client = _csrf_client(_user("proxy", "change_failedworkitem"))
    response = _post_action(client, reverse(LISTS["failedworkitem"]), "retry", [failed.pk])
    assert response.status_code == 403
    assert WorkItem.objects.get(pk=failed.pk).status == Status.FAILED
    index = client.get(reverse("admin:index")).content.decode()
    assert "Failed work items" not in index


def test_the_change_permission_of_work_items_gives_retry_on_the_failed_page() -> None:
    failed = make_item(handler="echo", status=Status.FAILED, attempts=3)
    client = _csrf_client(_user("operator", "change_workitem"))
    page = client.get(reverse(LISTS["failedworkitem"]))
    assert page.status_code == 200
    assert 'value="retry"' in page.content.decode()
    response = _post_action(client, reverse(LISTS["failedworkitem"]), "retry", [failed.pk])
    assert response.status_code == 302
    row = WorkItem.objects.get(pk=failed.pk)
    assert (row.status, row.attempts) == (Status.PENDING, 0)


def test_the_view_permission_of_work_items_gives_no_retry_on_the_failed_page() -> None:
    failed = make_item(handler="echo", status=Status.FAILED, attempts=3)
    client = _csrf_client(_user("viewer", "view_workitem", "change_failedworkitem"))
    page = client.get(reverse(LISTS["failedworkitem"])).content.decode()
    assert 'value="retry"' not in page
    _post_action(client, reverse(LISTS["failedworkitem"]), "retry", [failed.pk])
    assert WorkItem.objects.get(pk=failed.pk).status == Status.FAILED


def test_an_action_without_the_csrf_token_is_refused() -> None:
    failed = make_item(handler="echo", status=Status.FAILED, attempts=3)
    client = _csrf_client(_user("operator", "change_workitem"))
    response = client.post(
        reverse(LISTS["failedworkitem"]), {"action": "retry", "_selected_action": [failed.pk]}
    )
    assert response.status_code == 403
    assert WorkItem.objects.get(pk=failed.pk).status == Status.FAILED


# -- (8) sensitive covers results ------------------------------------------------------


def test_a_sensitive_handlers_result_is_redacted_everywhere(superuser_client: Client) -> None:
    # Only payload and result hold the secret: a sensitive handler's error
    # messages are redacted when they are written, not by the admin.
    values = {"payload": {"password": SECRET}, "result": {"token": SECRET}}
    succeeded = make_item(handler="secret", status=Status.SUCCEEDED, **values)
    failed = make_item(handler="secret", status=Status.FAILED, last_error="ValueError", **values)
    make_item(handler="secret", **values)
    (claimed,) = claim(limit=1, handlers=["secret"])
    WorkItem.objects.filter(pk=claimed.pk).update(**values)
    pages = [
        _change_url(succeeded),
        _change_url(failed),
        _change_url(failed, "failedworkitem"),
        _change_url(claimed, "claimedworkitem"),
        *(reverse(name) for name in LISTS.values()),
        reverse(SUMMARY),
    ]
    for url in pages:
        response = superuser_client.get(url)
        assert response.status_code == 200, url
        assert SECRET not in response.content.decode(), url
    detail = superuser_client.get(_change_url(succeeded)).content.decode()
    assert "(redacted: this handler is marked sensitive)" in detail
    assert superuser_client.get(_raw_url(succeeded, "result")).status_code == 403


def test_the_result_of_an_unregistered_handler_is_redacted(superuser_client: Client) -> None:
    item = make_item(handler="only-in-the-worker", status=Status.SUCCEEDED, result={"r": SECRET})
    detail = superuser_client.get(_change_url(item)).content.decode()
    assert SECRET not in detail
    assert "is not registered in this process" in detail


def test_a_plain_handlers_result_is_still_shown(superuser_client: Client) -> None:
    item = make_item(handler="echo", status=Status.SUCCEEDED, result={"r": "shown-result"})
    assert "shown-result" in superuser_client.get(_change_url(item)).content.decode()
