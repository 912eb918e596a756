"""Every admin page, filter, action and permission, through the test client."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.db.models.functions import Now
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from django_dbworker.models import Status, WorkItem
from tests.factories import age_heartbeat, claim, make_item

pytestmark = pytest.mark.django_db

CHANGELISTS = [
    "admin:django_dbworker_workitem_changelist",
    "admin:django_dbworker_claimedworkitem_changelist",
    "admin:django_dbworker_failedworkitem_changelist",
    "admin:django_dbworker_queuesummary_changelist",
]


def ids_on_page(html: str) -> set[int]:
    return {int(m) for m in re.findall(r'name="_selected_action" value="(\d+)"', html)} | {
        int(m) for m in re.findall(r"/(?:claimed|failed)?workitem/(\d+)/change/", html)
    }


@pytest.fixture
def mixed() -> dict[str, WorkItem]:
    items = {
        "pending": make_item(handler="echo", queue="q1", payload={"p": 1}),
        "failed": make_item(
            handler="noop",
            queue="q2",
            status=Status.FAILED,
            attempts=3,
            last_error="ValueError: broke\n\nTraceback (most recent call last):",
        ),
        "succeeded": make_item(handler="echo", status=Status.SUCCEEDED, result={"r": 2}),
        "cancelled": make_item(status=Status.CANCELLED),
    }
    make_item(handler="urgent", queue="urgent")
    (items["claimed"],) = claim(limit=1, handlers=["urgent"], worker="host:7:MainThread")
    return items


def test_anonymous_users_are_sent_to_login(client: Client) -> None:
    for name in CHANGELISTS:
        response = client.get(reverse(name))
        assert response.status_code == 302 and "/login/" in response["Location"]


def test_staff_without_permission_is_forbidden(staff_client: Client, mixed: dict) -> None:
    for name in CHANGELISTS:
        assert staff_client.get(reverse(name)).status_code == 403
    index = staff_client.get(reverse("admin:index")).content.decode()
    assert "Work items" not in index


def test_view_only_staff_sees_pages_without_actions(viewer_client: Client, mixed: dict) -> None:
    for name in CHANGELISTS:
        response = viewer_client.get(reverse(name))
        assert response.status_code == 200, name
        assert 'name="action"' not in response.content.decode()
    index = viewer_client.get(reverse("admin:app_list", args=["django_dbworker"])).content.decode()
    for label in ("Work items", "Claimed work items", "Failed work items", "Queue summary"):
        assert label in index


def test_view_only_staff_cannot_post_an_action(viewer_client: Client, mixed: dict) -> None:
    url = reverse("admin:django_dbworker_workitem_changelist")
    viewer_client.post(url, {"action": "retry", "_selected_action": [mixed["failed"].pk]})
    assert WorkItem.objects.get(pk=mixed["failed"].pk).status == Status.FAILED


def test_work_items_list_shows_every_row_with_badges_and_errors(
    superuser_client: Client, mixed: dict
) -> None:
    html = superuser_client.get(reverse(CHANGELISTS[0])).content.decode()
    assert ids_on_page(html) >= {i.pk for i in mixed.values()}
    assert 'class="dbw-status dbw-failed"' in html
    assert "ValueError: broke" in html and "Traceback" not in html  # first line only
    assert "1/3" in html or "0/3" in html
    assert 'name="action"' in html


def test_claimed_page_shows_only_claimed_rows_with_stale_marker(
    superuser_client: Client, mixed: dict
) -> None:
    age_heartbeat(mixed["claimed"], 3600)
    html = superuser_client.get(reverse(CHANGELISTS[1])).content.decode()
    assert ids_on_page(html) == {mixed["claimed"].pk}
    # host:pid, the claiming thread (always the main one in run_workers) on hover
    assert '<span title="host:7:MainThread">host:7</span>' in html
    assert ">stale<" in html
    # How long ago the claim was taken, the exact time to the second on hover.
    assert re.search(
        r'<span class="dbw-when" title="\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[^"]*">\d+s ago</span>', html
    )


def test_failed_page_shows_only_failed_rows_with_their_error(
    superuser_client: Client, mixed: dict
) -> None:
    html = superuser_client.get(reverse(CHANGELISTS[2])).content.decode()
    assert ids_on_page(html) == {mixed["failed"].pk}
    assert "ValueError: broke" in html and "3/3" in html


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("status__exact=failed", {"failed"}),
        ("status__exact=pending", {"pending"}),
        ("queue=q1", {"pending"}),
        ("handler=noop&status__exact=failed", {"failed"}),
    ],
)
def test_filters(superuser_client: Client, mixed: dict, query: str, expected: set[str]) -> None:
    html = superuser_client.get(f"{reverse(CHANGELISTS[0])}?{query}").content.decode()
    assert ids_on_page(html) == {mixed[k].pk for k in expected}


def test_filter_choices_come_from_registry_and_live_rows(
    superuser_client: Client, mixed: dict
) -> None:
    html = superuser_client.get(reverse(CHANGELISTS[0])).content.decode()
    for choice in ("?handler=flaky", "?queue=q2", "?queue=echoes"):
        assert choice in html


def test_search_by_id_handler_unique_key_and_concurrency_key(
    superuser_client: Client, mixed: dict
) -> None:
    keyed = make_item(handler="echo", unique_key="invoice:42")
    limited = make_item(handler="echo", concurrency_key="tenant-7")
    done = make_item(handler="echo", concurrency_key="tenant-7", status=Status.SUCCEEDED)
    make_item(handler="echo", concurrency_key="tenant-77")
    url = reverse(CHANGELISTS[0])
    html = superuser_client.get(url, {"q": str(mixed["failed"].pk)}).content.decode()
    assert ids_on_page(html) == {mixed["failed"].pk}
    # The help text under the box names every form (docs/topics/admin.md, "Searching").
    assert "concurrency key" in html and "payload.user.id=5" in html
    assert ids_on_page(superuser_client.get(url, {"q": "invoice:42"}).content.decode()) == {
        keyed.pk
    }
    # Pending or not; exact: "tenant-7" is not "tenant-77", nor is "tenant" either.
    assert ids_on_page(superuser_client.get(url, {"q": " tenant-7 "}).content.decode()) == {
        limited.pk,
        done.pk,
    }
    assert ids_on_page(superuser_client.get(url, {"q": "tenant"}).content.decode()) == set()
    by_handler = ids_on_page(superuser_client.get(url, {"q": "noop"}).content.decode())
    assert mixed["failed"].pk in by_handler and mixed["pending"].pk not in by_handler


@pytest.mark.parametrize(
    ("field", "key"),
    [
        ("unique_key", "{tenant-1}/daily"),  # not JSON
        ("unique_key", '{"order": 7}'),  # json.dumps(payload) as a dedup key
        ("concurrency_key", "payload.export"),  # no "=": not a payload search either
        ("concurrency_key", "payload.v=2"),
    ],
)
def test_a_key_in_a_payload_form_is_still_found_by_its_exact_value(
    superuser_client: Client, field: str, key: str
) -> None:
    """Any string is a valid unique or concurrency key, and the search finds a row by its
    exact key (shown on its change page, sensitive handler or not). A key that starts with
    ``{`` or ``payload.`` is read as a payload search only: an invalid one finds nothing
    with a warning, a valid one compares payloads and never the key."""
    row = make_item(handler="secret", payload={"order": 8, "v": 1}, **{field: key})
    response = superuser_client.get(reverse(CHANGELISTS[0]), {"q": key})
    assert response.status_code == 200
    assert ids_on_page(response.content.decode()) == {row.pk}


# -- the payload search ---------------------------------------------------------------

#: Payload values at the key "k", each in a row of its own (MISSING: no key "k").
MISSING = object()
STORED: list[Any] = [
    5, 5.0, "5", 1, 0, True, False, "true", None, "null", "Alice", "alice", "ALICE",
    "é", "a b", 'a"b', 0.1, 2**53, [5], ["x"], {"j": 5}, MISSING,
]  # fmt: skip


def _json_kind(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    return {int: "number", float: "number", str: "string"}.get(type(value), "other")


def _expected(rows: dict[int, Any], searched: Any) -> set[int]:
    """JSON equality: the same type, the same value; numbers as numbers (5 is 5.0)."""
    return {
        pk
        for pk, value in rows.items()
        if value is not MISSING and _json_kind(value) == _json_kind(searched) and value == searched
    }


@pytest.fixture
def payloads() -> dict[int, Any]:
    rows = {}
    for value in STORED:
        payload = {"other": 1} if value is MISSING else {"k": value, "other": 1}
        rows[make_item(handler="echo", payload=payload).pk] = value
    # Payloads that are no object, or NULL: never matched, never an error.
    make_item(handler="echo", payload=[5])
    make_item(handler="echo", payload="k")
    make_item(handler="echo", payload=None)
    return rows


@pytest.mark.parametrize(
    "searched", [5, 5.0, "5", 1, True, False, "true", None, "null", "alice", "é", 'a"b', 0.1, 2**53]
)
def test_payload_search_is_json_equality_on_every_database(
    superuser_client: Client, payloads: dict[int, Any], searched: Any
) -> None:
    """Both forms find exactly the rows whose value at the path has the same JSON type
    and value: ``5`` is not ``"5"``, ``true`` is neither ``1`` nor ``"true"``, ``null``
    is not ``"null"`` nor a missing key, text is compared with its case and accents."""
    expected = _expected(payloads, searched)
    url = reverse(CHANGELISTS[0])
    for term in (f"payload.k={json.dumps(searched)}", json.dumps({"k": searched})):
        response = superuser_client.get(url, {"q": term})
        assert response.status_code == 200, term
        assert ids_on_page(response.content.decode()) == expected, term


@pytest.mark.parametrize(
    ("term", "found"),
    [
        ("payload.k=alice", ["alice"]),  # not JSON: the text as typed
        ("payload.k = Alice ", ["Alice"]),  # spaces around the key and value go
        ('payload.k=" a b"', []),  # quoted: the spaces are the value's
        ("payload.k=a b", ["a b"]),
        ("payload.k=NaN", ["NaN"]),  # no JSON number: text
        ("payload.user.id=5", ["nested"]),
        ('{"user": {"id": 5}, "k": "x"}', ["nested"]),
        ('{"user": {"id": 5}, "k": "y"}', []),  # every leaf must hold
        ('{"5": "digits"}', ["digit key"]),  # a key, never an array index
        ("payload.5=digits", ["digit key"]),
        ('{"a.b": 1}', ["dotted key"]),  # a key with a dot: the object form
        ("payload.a.b=1", []),
    ],
)
def test_payload_search_forms(superuser_client: Client, term: str, found: list[str]) -> None:
    rows = {
        "alice": {"k": "alice"},
        "Alice": {"k": "Alice"},
        "a b": {"k": "a b"},
        "NaN": {"k": "NaN"},
        "nested": {"user": {"id": 5, "name": "x"}, "k": "x"},
        "digit key": {"5": "digits"},
        "dotted key": {"a.b": 1},
        "array": {"user": [{"id": 5}], "5": ["digits"], "a": [{"b": 1}]},
    }
    made = {name: make_item(handler="echo", payload=payload).pk for name, payload in rows.items()}
    response = superuser_client.get(reverse(CHANGELISTS[0]), {"q": term})
    assert response.status_code == 200
    assert ids_on_page(response.content.decode()) == {made[name] for name in found}


ODD_KEYS = ["é", "😀", "a b", "x-y", "$", "*", "[0]", "'", "a.b", "1", "\t", "ключ", "null"]


def test_payload_keys_are_matched_as_written(superuser_client: Client) -> None:
    """Keys in any script and with punctuation (but no quote, backslash or leading "-"):
    quoted in the JSON path, never a path expression of its own (``*``, ``[0]``) and
    never an array index (``1``)."""
    made = {key: make_item(handler="echo", payload={key: 1, "n": [1]}).pk for key in ODD_KEYS}
    url = reverse(CHANGELISTS[0])
    for key in ODD_KEYS:
        response = superuser_client.get(url, {"q": json.dumps({key: 1}, ensure_ascii=False)})
        assert ids_on_page(response.content.decode()) == {made[key]}, key
        response = superuser_client.get(url, {"q": json.dumps({key: 1})})  # \u escapes
        assert ids_on_page(response.content.decode()) == {made[key]}, key


def test_payload_search_works_on_every_list_and_with_the_filters(
    superuser_client: Client, mixed: dict
) -> None:
    failed = make_item(handler="echo", status=Status.FAILED, payload={"order": 7}, attempts=3)
    pending = make_item(handler="echo", payload={"order": 7})
    make_item(handler="noop", payload={"order": 7})
    term = {"q": "payload.order=7"}
    items = superuser_client.get(reverse(CHANGELISTS[0]), {**term, "handler": "echo"})
    assert ids_on_page(items.content.decode()) == {failed.pk, pending.pk}
    failed_list = superuser_client.get(reverse(CHANGELISTS[2]), term)
    assert ids_on_page(failed_list.content.decode()) == {failed.pk}


BAD_TERMS = [
    '{"user": ',
    "{}",
    '{"user": {}}',
    '{"tags": ["x"]}',
    "{" * 100_000,
    '{"' + '": {"'.join(["k"] * 17) + '": 1' + "}" * 17,
    json.dumps({f"k{i}": i for i in range(21)}),
    '{"a\\"b": 1}',
    '{"k": 1e400}',
    '{"k": NaN}',
    "payload.",
    "payload.k",
    "payload..k=1",
    "payload.k.=1",
    'payload.k="abc',
    "payload.k=[5]",
    'payload.k={"j": 5}',
    "payload.k=1e400",
    f"payload.k={2**53 + 1}",
    r'payload.k="\u0000"',
    r'payload.k="\ud800"',
    r"payload.k\=1",
    '{"-1": 1}',
    "payload.user.-a=1",
]


@pytest.mark.parametrize("term", BAD_TERMS)
def test_a_payload_search_that_is_not_valid_says_why_and_reads_no_payload(
    superuser_client: Client, term: str
) -> None:
    make_item(handler="echo", payload={"k": 1, "user": {"id": 5}, "tags": ["x"]})
    response = superuser_client.get(reverse(CHANGELISTS[0]), {"q": term})
    assert response.status_code == 200
    html = response.content.decode()
    assert ids_on_page(html) == set()
    assert 'class="warning"' in html and "Payloads not searched: " in html


def test_a_plain_word_never_reads_payloads(superuser_client: Client) -> None:
    """Only a term in a payload form reads payloads: plain words stay indexed lookups."""
    make_item(handler="echo", payload={"k": "alice"})
    for term in ("alice", "k=alice", "user.id=5", "payloads.k=1"):
        with CaptureQueriesContext(connection) as ctx:
            response = superuser_client.get(reverse(CHANGELISTS[0]), {"q": term})
        assert response.status_code == 200 and ids_on_page(response.content.decode()) == set()
        read = [q["sql"] for q in ctx.captured_queries if re.search(r"[\"`]payload[\"`]", q["sql"])]
        assert not read, term


@pytest.mark.postgres_only
def test_a_gin_index_on_payload_serves_the_payload_search(superuser_client: Client) -> None:
    """``@>`` containment: a GIN index a project adds (docs/topics/admin.md) is used."""
    item = make_item(handler="echo", payload={"user": {"id": 5}})
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE INDEX test_payload_gin ON django_dbworker_workitem "
            "USING gin (payload jsonb_path_ops)"
        )
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("SET LOCAL enable_indexscan = off")
    url = reverse(CHANGELISTS[0])
    with CaptureQueriesContext(connection) as ctx:
        response = superuser_client.get(url, {"q": "payload.user.id=5"})
    assert ids_on_page(response.content.decode()) == {item.pk}
    [listed] = [q["sql"] for q in ctx.captured_queries if "@>" in q["sql"] and "LIMIT" in q["sql"]]
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + listed.replace("%", "%%"))
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "Bitmap Index Scan on test_payload_gin" in plan, plan


@pytest.mark.parametrize("term", ["²", "12²"])
def test_search_for_non_ascii_digits_finds_nothing(
    superuser_client: Client, mixed: dict, term: str
) -> None:
    # "²".isdigit() is true but int("²") fails; only ASCII digits are ids.
    response = superuser_client.get(reverse(CHANGELISTS[0]), {"q": term})
    assert response.status_code == 200
    assert ids_on_page(response.content.decode()) == set()


def test_every_page_renders_a_row_with_an_unknown_status(
    superuser_client: Client, mixed: dict
) -> None:
    # Written by a newer version or by hand: the admin must still show it.
    odd = make_item(handler="echo", queue="q1")
    WorkItem.objects.filter(pk=odd.pk).update(status="weird")
    for name in CHANGELISTS:
        response = superuser_client.get(reverse(name))
        assert response.status_code == 200, name
    listed = superuser_client.get(reverse(CHANGELISTS[0])).content.decode()
    assert odd.pk in ids_on_page(listed) and 'class="dbw-status dbw-weird"' in listed
    summary = superuser_client.get(reverse(CHANGELISTS[3])).content.decode()
    assert "?queue=q1&amp;status__exact=weird" in summary
    for model in ("workitem", "claimedworkitem", "failedworkitem"):
        url = reverse(f"admin:django_dbworker_{model}_change", args=[odd.pk])
        response = superuser_client.get(url, follow=True)
        assert response.status_code == 200, model
    detail = superuser_client.get(
        reverse("admin:django_dbworker_workitem_change", args=[odd.pk])
    ).content.decode()
    assert "weird" in detail


def test_detail_page_is_read_only_and_pretty(superuser_client: Client, mixed: dict) -> None:
    item = mixed["failed"]
    WorkItem.objects.filter(pk=item.pk).update(
        trace_context={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    )
    url = reverse("admin:django_dbworker_workitem_change", args=[item.pk])
    html = superuser_client.get(url).content.decode()
    assert "<pre" in html and "Traceback (most recent call last):" in html
    assert "0af7651916cd43dd8448eb211c80319c" in html
    assert 'name="_save"' not in html
    assert superuser_client.post(url, {"handler": "x"}).status_code == 403
    assert WorkItem.objects.get(pk=item.pk).handler == "noop"


def test_detail_page_pretty_prints_payload_and_result(
    superuser_client: Client, mixed: dict
) -> None:
    url = reverse("admin:django_dbworker_workitem_change", args=[mixed["succeeded"].pk])
    html = superuser_client.get(url).content.decode()
    assert "&quot;r&quot;: 2" in html


def test_sensitive_payload_is_redacted(superuser_client: Client) -> None:
    item = make_item(handler="secret", payload={"password": "hunter2"})
    url = reverse("admin:django_dbworker_workitem_change", args=[item.pk])
    html = superuser_client.get(url).content.decode()
    assert "hunter2" not in html and "redacted" in html


def test_payload_of_an_unregistered_handler_is_redacted(superuser_client: Client) -> None:
    # Not registered in this process: it cannot be told whether the handler
    # is sensitive, so the payload stays hidden (fail closed).
    item = make_item(handler="only-in-the-worker", payload={"password": "hunter2"})
    url = reverse("admin:django_dbworker_workitem_change", args=[item.pk])
    html = superuser_client.get(url).content.decode()
    assert "hunter2" not in html
    assert (
        "(redacted: handler only-in-the-worker is not registered in this process, "
        "so it cannot be told whether its payload is sensitive)"
    ) in html


def test_payload_of_a_registered_plain_handler_is_shown(superuser_client: Client) -> None:
    item = make_item(handler="echo", payload={"visible": "yes-shown"})
    url = reverse("admin:django_dbworker_workitem_change", args=[item.pk])
    assert "yes-shown" in superuser_client.get(url).content.decode()


@pytest.mark.parametrize(
    ("action", "selected", "changed", "new_status"),
    [
        (
            "retry",
            ["failed", "cancelled", "pending"],
            2,
            {"failed": "pending", "cancelled": "pending"},
        ),
        ("cancel", ["pending", "failed", "claimed"], 1, {"pending": "cancelled"}),
        ("run_now", ["pending", "succeeded"], 1, {"pending": "pending"}),
    ],
)
def test_actions_change_eligible_rows_and_report_skips(
    superuser_client: Client,
    mixed: dict,
    action: str,
    selected: list[str],
    changed: int,
    new_status: dict[str, str],
) -> None:
    before = {k: WorkItem.objects.get(pk=v.pk).status for k, v in mixed.items()}
    response = superuser_client.post(
        reverse(CHANGELISTS[0]),
        {"action": action, "_selected_action": [mixed[k].pk for k in selected]},
        follow=True,
    )
    text = response.content.decode()
    assert f"{changed} work item(s)" in text
    skipped = len(selected) - changed
    assert (f"{skipped} skipped" in text) == bool(skipped)
    for key, item in mixed.items():
        expected = new_status.get(key, before[key])
        assert WorkItem.objects.get(pk=item.pk).status == expected, key


def test_retry_resets_attempts(superuser_client: Client, mixed: dict) -> None:
    superuser_client.post(
        reverse(CHANGELISTS[2]), {"action": "retry", "_selected_action": [mixed["failed"].pk]}
    )
    row = WorkItem.objects.get(pk=mixed["failed"].pk)
    assert (row.status, row.attempts) == (Status.PENDING, 0)


def test_summary_counts_lag_and_stale_claims(superuser_client: Client, mixed: dict) -> None:
    age_heartbeat(mixed["claimed"], 3600)
    html = superuser_client.get(reverse(CHANGELISTS[3])).content.decode()
    assert "Work items by queue" in html
    assert "?queue=q2&amp;status__exact=failed" in html
    assert "host:7:MainThread" in html  # listed as a stale claim


def test_summary_lists_pending_work_of_unregistered_handlers(
    superuser_client: Client, mixed: dict
) -> None:
    for age in (7200, 60):
        make_item(handler="gone-handler", created_at=Now() - timedelta(seconds=age))
    make_item(handler="gone-finished", status=Status.FAILED)  # nothing waits for it
    html = superuser_client.get(reverse(CHANGELISTS[3])).content.decode()
    assert "Pending work of handlers not registered in this process" in html
    section = html.split("Pending work of handlers not registered")[1]
    assert "?handler=gone-handler&amp;status__exact=pending" in section
    assert re.search(r"gone-handler</a></td>\s*<td>2</td>\s*<td>2h ago</td>", section)
    assert "gone-finished" not in html
    listed = superuser_client.get(
        reverse(CHANGELISTS[0]), {"handler": "gone-handler", "status__exact": "pending"}
    ).content.decode()
    assert len(ids_on_page(listed)) == 2
    # Each row says it will not run, and why.
    assert listed.count("gone-handler <strong") == 2
    assert "is it defined in a workers.py module" in listed
    registered = superuser_client.get(reverse(CHANGELISTS[0])).content.decode()
    assert "urgent <strong" not in registered


def test_summary_without_unregistered_handlers_says_so(
    superuser_client: Client, mixed: dict
) -> None:
    html = superuser_client.get(reverse(CHANGELISTS[3])).content.decode()
    assert "None: every handler with pending work is registered" in html


def test_list_pages_never_load_payload_result_or_traceback(
    superuser_client: Client, mixed: dict
) -> None:
    qn = connection.ops.quote_name  # "name" here, `name` on MySQL
    for name in CHANGELISTS[:3]:
        with CaptureQueriesContext(connection) as ctx:
            superuser_client.get(reverse(name))
        # The row query is the one that selects the annotated clock.
        row_queries = [q["sql"] for q in ctx.captured_queries if qn("db_now") in q["sql"]]
        assert row_queries, name
        for sql in row_queries:
            selected = sql.upper().split(" FROM ")[0]
            assert qn("PAYLOAD") not in selected and qn("RESULT") not in selected
            assert qn("TRACE_CONTEXT") not in selected
            # last_error only as its first 300 characters, never whole
            assert selected.count(qn("LAST_ERROR")) == selected.count("LEFT(") + selected.count(
                "SUBSTR("
            )


#: Queries per page, session and user included. The summary is a dashboard:
#: counts and lag (3), stale claims, orphans, and the last hour's throughput,
#: run times and failures, one query each, and the paused queues (QueueState).
BUDGETS = {"admin:django_dbworker_queuesummary_changelist": 11}


def _queries(client: Client, url: str) -> int:
    with CaptureQueriesContext(connection) as ctx:
        assert client.get(url).status_code == 200
    return len(ctx.captured_queries)


@pytest.mark.parametrize("name", CHANGELISTS)
def test_query_budget_does_not_grow_with_rows(superuser_client: Client, name: str) -> None:
    make_item()
    small = _queries(superuser_client, reverse(name))
    for n in range(60):
        make_item(handler="echo", queue=f"q{n % 3}", status=[Status.FAILED, Status.PENDING][n % 2])
    for item in claim(limit=10):
        age_heartbeat(item, 3600)
    big = _queries(superuser_client, reverse(name))
    assert big == small
    assert big <= BUDGETS.get(name, 8)


def test_facet_counts_are_off(superuser_client: Client, mixed: dict) -> None:
    html = superuser_client.get(reverse(CHANGELISTS[0]) + "?_facets=True").content.decode()
    assert "Show counts" not in html and "Hide counts" not in html


def test_retrying_two_rows_of_one_unique_key_keeps_the_key_unique(
    superuser_client: Client,
) -> None:
    a = make_item(handler="echo", status=Status.FAILED, unique_key="same")
    b = make_item(handler="echo", status=Status.FAILED, unique_key="same")
    response = superuser_client.post(
        reverse(CHANGELISTS[0]),
        {"action": "retry", "_selected_action": [a.pk, b.pk]},
        follow=True,
    )
    text = response.content.decode()
    statuses = sorted(WorkItem.objects.values_list("status", flat=True))
    # PostgreSQL checks the UPDATE against one snapshot: the unique index
    # refuses it and nothing changes. SQLite sees the first row turn pending
    # before it tests the second, which is then skipped. Either way at most
    # one row holds the key, and the operator is told.
    if "share a unique key" in text:
        assert statuses == [Status.FAILED, Status.FAILED]
    else:
        assert "1 work item(s) set to pending" in text and "1 skipped" in text
        assert statuses == [Status.FAILED, Status.PENDING]


# -- the dashboard (Queue summary): the last hour in pictures ---------------------

SUMMARY = "admin:django_dbworker_queuesummary_changelist"


def _db_now() -> datetime:
    """The database clock, which the dashboard's windows and minutes follow."""
    probe = make_item(handler="clock-probe", status=Status.CANCELLED)
    now: datetime = (
        WorkItem.objects.annotate(now=Now()).values_list("now", flat=True).get(pk=probe.pk)
    )
    probe.delete()
    return now


def _finished(
    handler: str, status: str, finished_at: datetime, run: float = 1.0, **fields: object
) -> WorkItem:
    return make_item(
        handler=handler,
        status=status,
        finished_at=finished_at,
        claimed_at=finished_at - timedelta(seconds=run),
        attempts=1,
        **fields,
    )


def _minute(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M")


def _queue_row(html: str, queue: str) -> str:
    match = re.search(rf'<tr data-queue="{queue}">(.*?)</tr>', html, re.DOTALL)
    assert match, f"no throughput row for {queue}"
    return match.group(1)


def _bars(row: str) -> list[tuple[str, int, int]]:
    return [
        (minute, int(s), int(f))
        for minute, s, f in re.findall(
            r'class="dbw-bar" data-minute="([^"]+)" data-succeeded="(\d+)" data-failed="(\d+)"', row
        )
    ]


def test_dashboard_charts_finished_rows_per_queue_and_minute(superuser_client: Client) -> None:
    now = _db_now()
    five, twenty = now - timedelta(minutes=5), now - timedelta(minutes=20)
    for _ in range(3):
        _finished("echo", Status.SUCCEEDED, five, queue="q1")
    _finished("echo", Status.FAILED, five, queue="q1", last_error="ValueError: x")
    _finished("echo", Status.SUCCEEDED, twenty, queue="q1")
    _finished("echo", Status.SUCCEEDED, twenty, queue="q1")
    _finished("noop", Status.FAILED, twenty, queue="q2", last_error="KeyError: y")
    # Outside the picture: older than the hour, cancelled, still live.
    for _ in range(4):
        _finished("echo", Status.SUCCEEDED, now - timedelta(hours=2), queue="q1")
    _finished("echo", Status.CANCELLED, five, queue="q1")
    make_item(handler="echo", queue="q3")

    html = superuser_client.get(reverse(SUMMARY)).content.decode()
    q1 = _bars(_queue_row(html, "q1"))
    assert len(q1) == 60
    assert [bar for bar in q1 if bar[1] or bar[2]] == [
        (_minute(twenty), 2, 0),
        (_minute(five), 3, 1),
    ]
    # The last bar is the current minute (the next one if it began meanwhile).
    assert q1[-1][0] in {_minute(now), _minute(now + timedelta(minutes=1))}
    q2 = _bars(_queue_row(html, "q2"))
    assert [bar for bar in q2 if bar[1] or bar[2]] == [(_minute(twenty), 0, 1)]
    # A queue with live rows only has an empty chart.
    assert not [bar for bar in _bars(_queue_row(html, "q3")) if bar[1] or bar[2]]
    # Totals for the hour; the failures link to the Failed list of the queue.
    q1_cells = re.findall(r'<td class="dbw-num">(.*?)</td>', _queue_row(html, "q1"), re.DOTALL)
    assert q1_cells[0] == "4/min" and q1_cells[1] == "5"
    assert "failedworkitem/?queue=q1" in q1_cells[2] and ">1</a>" in q1_cells[2]
    # Drawn: 4 stacked rectangles in q1's two busy minutes (plus one hit area per minute).
    assert _queue_row(html, "q1").count("<rect") == 60 + 3


def test_dashboard_shows_run_time_percentiles_per_handler(superuser_client: Client) -> None:
    now = _db_now()
    for i, seconds in enumerate((1, 2, 3, 4, 10)):
        _finished("echo", Status.SUCCEEDED, now - timedelta(minutes=i + 1), run=seconds)
    for seconds in (0.2, 0.4):
        _finished("noop", Status.SUCCEEDED, now - timedelta(minutes=3), run=seconds)
    # Not counted: too old, or not a success.
    _finished("echo", Status.SUCCEEDED, now - timedelta(hours=2), run=100)
    _finished("echo", Status.FAILED, now - timedelta(minutes=2), run=100, last_error="E")

    html = superuser_client.get(reverse(SUMMARY)).content.decode()

    def cells(handler: str) -> tuple[str, str, str]:
        match = re.search(rf'<tr data-handler="{handler}">(.*?)</tr>', html, re.DOTALL)
        assert match, handler
        row = match.group(1)
        count = re.findall(r'<td class="dbw-num">(\d+)</td>', row)[0]
        p50 = re.search(r'dbw-p50">([^<]+)<', row)
        p95 = re.search(r'dbw-p95">([^<]+)<', row)
        assert p50 and p95
        return count, p50.group(1), p95.group(1)

    # percentile_cont: p95 of 1, 2, 3, 4, 10 is 4 + 0.8 * (10 - 4).
    assert cells("echo") == ("5", "3.0 s", "8.8 s")
    assert cells("noop") == ("2", "300 ms", "390 ms")
    assert "from the latest" not in html  # nothing was sampled


def test_run_times_in_python_use_only_the_latest_rows() -> None:
    """The portable computation (SQLite's) reads at most ``sample`` rows, newest first."""
    from django_dbworker.db import operations
    from django_dbworker.db.base import VendorOperations
    from django_dbworker.stats import RECENT

    now = _db_now()
    for minutes, seconds in ((1, 5), (2, 7), (3, 100)):
        _finished("echo", Status.SUCCEEDED, now - timedelta(minutes=minutes), run=seconds)
    (latest,) = VendorOperations.run_times(operations(), RECENT, sample=2)
    assert (latest.handler, latest.count, latest.p50, latest.sampled) == ("echo", 2, 6.0, True)
    (whole,) = VendorOperations.run_times(operations(), RECENT, sample=3)
    assert (whole.count, whole.p50, whole.sampled) == (3, 7.0, False)


def test_dashboard_groups_recent_failures_by_error(superuser_client: Client) -> None:
    now = _db_now()
    for i in range(3):
        _finished(
            "echo",
            Status.FAILED,
            now - timedelta(minutes=10 + i),
            last_error=f"ValueError: bad input\n\nTraceback (most recent call last):\n  line {i}",
        )
    _finished("echo", Status.FAILED, now - timedelta(minutes=4), last_error="KeyError: x")
    _finished(
        "noop", Status.FAILED, now - timedelta(minutes=30), last_error="ValueError: bad input\n"
    )
    _finished("noop", Status.FAILED, now - timedelta(hours=2), last_error="OldError: gone")
    _finished("noop", Status.SUCCEEDED, now - timedelta(minutes=1), last_error="")

    html = superuser_client.get(reverse(SUMMARY)).content.decode()
    section = html.split('id="dbw-failures"')[1].split("</table>")[0]
    rows = re.findall(
        r"<code>(.*?)</code></td>\s*<td><a href=\"([^\"]+)\">(.*?)</a></td>\s*"
        r'<td class="dbw-num"><a href="[^"]+">(\d+)</a></td>\s*<td>(.*?)</td>',
        section,
    )
    failed_list = reverse("admin:django_dbworker_failedworkitem_changelist")
    assert rows == [
        ("ValueError: bad input", f"{failed_list}?handler=echo", "echo", "3", "10m ago"),
        ("KeyError: x", f"{failed_list}?handler=echo", "echo", "1", "4m ago"),
        ("ValueError: bad input", f"{failed_list}?handler=noop", "noop", "1", "30m ago"),
    ]
    assert "OldError" not in html
    # The link shows exactly that handler's failed rows.
    listed = superuser_client.get(f"{failed_list}?handler=echo").content.decode()
    assert len(ids_on_page(listed)) == 4


def test_dashboard_of_an_empty_table_says_so(superuser_client: Client) -> None:
    html = superuser_client.get(reverse(SUMMARY)).content.decode()
    assert "Nothing succeeded in the last 60 minutes." in html
    assert "None: nothing failed in the last 60 minutes." in html
    assert 'class="dbw-bar"' not in html


def test_dashboard_says_when_it_was_updated_and_refreshes_itself(
    superuser_client: Client,
) -> None:
    now = _db_now()
    html = superuser_client.get(reverse(SUMMARY)).content.decode()
    updated = re.search(r'id="dbw-updated-at"><span title="([^"]+)"', html)
    assert updated
    shown = datetime.fromisoformat(updated.group(1))
    assert abs((shown - now).total_seconds()) < 60
    # An inline script re-fetches the page; without JavaScript, a meta refresh.
    assert "fetch(window.location.href" in html
    assert '<noscript><meta http-equiv="refresh" content="5"></noscript>' in html


def test_dashboard_needs_the_view_permission(
    staff_client: Client, viewer_client: Client, client: Client
) -> None:
    _finished("echo", Status.FAILED, _db_now(), last_error="ValueError: secret-ish")
    assert staff_client.get(reverse(SUMMARY)).status_code == 403
    assert client.get(reverse(SUMMARY)).status_code == 302
    html = viewer_client.get(reverse(SUMMARY)).content.decode()
    assert "ValueError: secret-ish" in html and 'id="dbw-throughput"' in html


@pytest.mark.sqlite_only
def test_dashboard_queries_search_the_finished_index_on_sqlite() -> None:
    """SQLite's planner too: each last-hour query is a range search of dbworker_finished_idx."""
    from django_dbworker import stats

    with CaptureQueriesContext(connection) as ctx:
        stats.throughput()
        stats.run_times()
        stats.failure_groups()
    assert len(ctx.captured_queries) == 3
    for query in ctx.captured_queries:
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN QUERY PLAN " + query["sql"].replace("%", "%%"))
            plan = " | ".join(str(row[-1]) for row in cursor.fetchall())
        assert "USING INDEX dbworker_finished_idx (finished_at>?)" in plan, plan


def test_change_page_lists_each_failed_attempt_newest_first(superuser_client: Client) -> None:
    item = make_item(
        status=Status.FAILED,
        error_history=[
            {
                "attempt": 1,
                "worker": "h:1:MainThread",
                "exception_class_path": "x.First",
                "error": "first <b>boom</b>\nTraceback ...",
                "finished_at": "2026-11-30T10:00:00+00:00",
            },
            "garbage",
            {
                "attempt": 2,
                "worker": "h:2:MainThread",
                "exception_class_path": "x.Second",
                "error": "second boom",
            },
        ],
    )
    url = reverse("admin:django_dbworker_workitem_change", args=[item.pk])
    html = superuser_client.get(url).content.decode()
    assert "failed attempts" in html.lower()
    assert html.index("x.Second") < html.index("x.First")  # newest first
    assert "first &lt;b&gt;boom&lt;/b&gt;" in html and "<b>boom" not in html  # escaped
    assert "2026-11-30 10:00:00" in html
    # The row's own times are to the second too, not Django's "10 p.m.".
    assert re.search(r">\d{4}-\d\d-\d\d \d\d:\d\d:\d\d</span>", html.split("failed attempts")[0])
    garbage = make_item(status=Status.FAILED, error_history={"not": "a list"})
    url = reverse("admin:django_dbworker_workitem_change", args=[garbage.pk])
    assert superuser_client.get(url).status_code == 200


def test_the_change_page_shows_the_concurrency_key_and_limit(superuser_client: Client) -> None:
    from tests.testapp.workers import Keyed

    item = Keyed.enqueue({"key": "a"}, concurrency_key="customer:42")
    url = reverse("admin:django_dbworker_workitem_change", args=[item.pk])
    html = superuser_client.get(url).content.decode()
    assert "customer:42" in html
    assert "Concurrency limit" in html


@pytest.mark.parametrize(
    ("term", "spaced"),
    [
        ('payload.k="alice "', "alice "),
        ('{"k": "alice "}', "alice "),
        ('{"k": "alice  "}', "alice  "),
        ('{"k": "a b "}', "a b "),
    ],
)
def test_payload_search_counts_trailing_spaces_of_text(
    superuser_client: Client, term: str, spaced: str
) -> None:
    """Exact means exact: "alice " is not "alice". MariaDB's ``utf8mb4_bin`` is a PAD SPACE
    collation (``=`` ignores trailing spaces), so there the search also finds the row
    without them; migration 0001 gives the key columns ``utf8mb4_nopad_bin`` for this."""
    make_item(handler="echo", payload={"k": spaced.rstrip()})
    wanted = make_item(handler="echo", payload={"k": spaced})
    response = superuser_client.get(reverse(CHANGELISTS[0]), {"q": term})
    assert response.status_code == 200
    assert ids_on_page(response.content.decode()) == {wanted.pk}


@pytest.mark.parametrize(
    "term",
    [
        "payload.k=9007199254740992.0",  # 2**53 as a float: also 2**53 + 1 as a double
        "payload.k=9.007199254740993e15",
        '{"k": 1152921504606846976.0}',  # 2**60
    ],
)
def test_a_number_beyond_2_53_is_refused_however_it_is_written(
    superuser_client: Client, term: str
) -> None:
    """``payload.k=9007199254740993`` is refused (numbers past ±2**53 are not compared
    exactly on SQLite and MariaDB); the same number written as a float is not, and the
    databases then disagree: MariaDB finds 2**53 + 1 for ``9007199254740992.0``, SQLite
    and MariaDB find 2**60 for ``1152921504606846976.0``, PostgreSQL neither."""
    make_item(handler="echo", payload={"k": 2**53 + 1})
    make_item(handler="echo", payload={"k": 2**60})
    response = superuser_client.get(reverse(CHANGELISTS[0]), {"q": term})
    assert response.status_code == 200
    html = response.content.decode()
    assert ids_on_page(html) == set()
    assert "Payloads not searched: " in html
