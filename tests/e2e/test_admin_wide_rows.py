"""The admin lists at 1280x800 with long handler names and errors, in a real Chromium.

Django's navigation sidebar is open, as it is for anyone who never closed
it. Every list's key column (the Failed list's error, the Claimed list's
stale marker, the Work items list's error and where each row stands) must
be on screen without the horizontal scrollbar of the results table, and
the cells a row is read by (id, status, handler, queue, times) whole: not
cut, not hidden. Screenshots go to ``$DBWORKER_SCREENSHOT_DIR`` when it is
set (the issue's closing note).
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.db.models.functions import Now

from django_dbworker.models import Status, WorkItem
from tests.e2e.test_admin_browser import browser_page  # noqa: F401  (the fixture)
from tests.factories import age_heartbeat, make_item

pytestmark = pytest.mark.django_db(transaction=True)

WIDTH, HEIGHT = 1280, 800
LONG_HANDLER = "billing.reconciliation.reconcile_customer_invoices_for_period_{}"
LONG_QUEUE = "billing-reconciliation-eu-west"
LONG_ERROR = (
    "psycopg.errors.UniqueViolation: duplicate key value violates unique constraint "
    '"billing_invoice_customer_id_period_key" DETAIL: Key (customer_id, period)=({}, 2026-11) '
    "already exists.\n\nTraceback (most recent call last):\n  ..."
)
LONG_WORKER = "ip-10-20-30-40.eu-west-1.compute.internal:1234567:ThreadPoolExecutor-3_{}"


def _seed() -> None:
    for i in range(12):
        item = make_item(
            handler=LONG_HANDLER.format(i),
            queue=LONG_QUEUE,
            status=Status.FAILED,
            attempts=10,
            max_attempts=10,
            last_error=LONG_ERROR.format(100_000 + i),
        )
        WorkItem.objects.filter(pk=item.pk).update(claimed_at=Now(), finished_at=Now())
    for i in range(12):
        item = make_item(
            handler=LONG_HANDLER.format(i),
            queue=LONG_QUEUE,
            status=Status.CLAIMED,
            attempts=1,
            claimed_by=LONG_WORKER.format(i),
        )
        WorkItem.objects.filter(pk=item.pk).update(claimed_at=item.created_at)
        age_heartbeat(item, 600 if i % 2 else 5)
    for i in range(6):
        make_item(handler=LONG_HANDLER.format(i), queue=LONG_QUEUE, priority=100)


def _log_in(page, url: str) -> None:  # type: ignore[no-untyped-def]
    User.objects.create_superuser("admin", "admin@example.com", "s3cret-pass")
    page.set_viewport_size({"width": WIDTH, "height": HEIGHT})
    # Django's nav_sidebar.js reads this before the page is drawn: open.
    page.add_init_script("localStorage.setItem('django.admin.navSidebarIsOpen', 'true')")
    page.goto(url)
    page.fill("#id_username", "admin")
    page.fill("#id_password", "s3cret-pass")
    page.click("input[type=submit]")
    page.wait_for_selector("#result_list")


def _outside(page, selector: str) -> list[dict[str, float]]:  # type: ignore[no-untyped-def]
    """The cells of ``selector`` whose right edge is past the window's (none may be)."""
    result: list[dict[str, float]] = page.evaluate(
        """(selector) => {
            const cells = Array.from(document.querySelectorAll(selector));
            if (!cells.length) { return [{missing: selector}]; }
            return cells
                .map((cell) => ({
                    right: cell.getBoundingClientRect().right, width: window.innerWidth,
                }))
                .filter((box) => box.right > box.width);
        }""",
        selector,
    )
    return result


def _screenshot(page, name: str) -> None:  # type: ignore[no-untyped-def]
    folder = os.environ.get("DBWORKER_SCREENSHOT_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / f"{name}.png"))


@pytest.mark.parametrize(
    ("page_name", "selectors"),
    [
        ("failedworkitem", ["td.field-error_summary", "td.field-attempts_display"]),
        ("claimedworkitem", ["td.field-heartbeat_and_stale"]),
        (
            "workitem",
            [
                "td.field-handler_and_error",
                "td.field-status_badge",
                "td.field-progress",
                "td.field-progress .dbw-stale",
            ],
        ),
    ],
)
def test_every_lists_key_column_is_on_screen_at_1280_px(  # type: ignore[no-untyped-def]
    browser_page,  # noqa: F811
    live_server,
    page_name: str,
    selectors: list[str],
) -> None:
    _seed()
    page = browser_page
    _log_in(page, f"{live_server.url}/admin/django_dbworker/{page_name}/")
    assert page.evaluate("window.innerWidth") == WIDTH
    _screenshot(page, f"{page_name}-1280x800")
    for selector in selectors:
        assert _outside(page, selector) == [], selector
    # No horizontal scrollbar: the results table fits its box.
    overflow = page.evaluate(
        "(() => { const r = document.querySelector('.results');"
        " return r.scrollWidth - r.clientWidth; })()"
    )
    assert overflow <= 0
    # Cut text keeps the whole value on hover.
    if page_name == "failedworkitem":
        cell = page.locator("td.field-error_summary [title]").first
        assert (cell.get_attribute("title") or "").startswith("psycopg.errors.UniqueViolation")
    if page_name == "claimedworkitem":
        assert page.locator("td.field-heartbeat_and_stale .dbw-stale").count() == 6


#: The cells a row is read by, on each list: id, status, handler, queue and
#: times. Inside them only a ``.dbw-cut`` value may be cut (the error and the
#: worker, whole on hover and on the row's page).
WHOLE_CELLS = {
    "workitem": [
        "th.field-id",
        "td.field-status_badge",
        "td.field-handler_and_error",
        "td.field-progress",
    ],
    "failedworkitem": ["th.field-id", "td.field-handler_and_queue", "td.field-finished"],
    "claimedworkitem": [
        "th.field-id",
        "td.field-status_badge",
        "td.field-heartbeat_and_stale",
        "td.field-handler_and_queue",
        "td.field-worker_and_claimed .dbw-when",
    ],
}


def _cut(page, selector: str) -> list[object]:  # type: ignore[no-untyped-def]
    """What of the cells of ``selector`` is not shown whole (nothing may be).

    A cell that scrolls (its content is wider than it), or a piece of its
    text outside the box of the cell or of any element between them that
    clips (overflow other than visible), outside a ``.dbw-cut`` value; an
    id on more than one line; a cell not wholly inside the results' box.
    """
    result: list[object] = page.evaluate(
        """(selector) => {
            const cells = Array.from(document.querySelectorAll(selector));
            if (!cells.length) { return [{missing: selector}]; }
            const cut = [];
            const results = document.querySelector('.results').getBoundingClientRect();
            for (const cell of cells) {
                const place = cell.getBoundingClientRect();
                if (place.left < results.left || place.right > results.right + 0.5) {
                    cut.push({outside: cell.innerText, left: place.left, right: place.right});
                }
                const link = cell.matches('th.field-id') && cell.querySelector('a');
                if (link && link.getClientRects().length > 1) {
                    cut.push({id_wraps: link.innerText});
                }
                if (cell.scrollWidth > cell.clientWidth) {
                    cut.push({cell: cell.innerText, scroll: cell.scrollWidth,
                              client: cell.clientWidth});
                }
                const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
                for (let text = walker.nextNode(); text; text = walker.nextNode()) {
                    if (!text.textContent.trim() || text.parentElement.closest('.dbw-cut')) {
                        continue;
                    }
                    const range = document.createRange();
                    range.selectNodeContents(text);
                    for (const line of Array.from(range.getClientRects())) {
                        for (let box = text.parentElement; ; box = box.parentElement) {
                            const style = getComputedStyle(box);
                            const clips = box === cell || style.overflowX !== 'visible';
                            const edge = box.getBoundingClientRect();
                            if (clips && (line.left < edge.left - 0.5
                                          || line.right > edge.right + 0.5)) {
                                cut.push({text: text.textContent, in: box.className});
                            }
                            if (box === cell) { break; }
                        }
                    }
                }
            }
            return cut;
        }""",
        selector,
    )
    return result


def _seed_every_kind_of_row() -> None:
    """``_seed``'s long names, plus 8-digit ids, every status and the widest times."""
    _seed()
    ids = 12_345_670
    for status in (Status.SUCCEEDED, Status.CANCELLED, Status.FAILED):
        item = make_item(
            id=ids,
            handler="send_welcome_email",
            queue="emails",
            status=status,
            attempts=3,
            last_error="SMTPServerDisconnected: Connection unexpectedly closed",
        )
        ids += 1
        # The widest relative time of an hour: "12m 30s ago", "59m 59s ago".
        WorkItem.objects.filter(pk=item.pk).update(
            claimed_at=Now() - timedelta(minutes=60), finished_at=Now() - timedelta(seconds=3599)
        )
    asked = make_item(
        id=ids,
        handler="send_welcome_email",
        queue="emails",
        status=Status.CLAIMED,
        attempts=1,
        claimed_by=LONG_WORKER.format(99),
    )
    WorkItem.objects.filter(pk=asked.pk).update(
        claimed_at=Now() - timedelta(seconds=750), cancel_requested_at=Now()
    )
    age_heartbeat(asked, 3599)


@pytest.mark.parametrize("page_name", sorted(WHOLE_CELLS))
def test_id_status_handler_queue_and_times_are_whole_at_1280_px_beside_the_sidebar(  # type: ignore[no-untyped-def]
    browser_page,  # noqa: F811
    live_server,
    page_name: str,
) -> None:
    _seed_every_kind_of_row()
    page = browser_page
    _log_in(page, f"{live_server.url}/admin/django_dbworker/{page_name}/")
    # The navigation sidebar is open and takes its room.
    assert page.evaluate("document.getElementById('main').classList.contains('shifted')")
    sidebar = page.locator("#nav-sidebar").bounding_box()
    assert sidebar is not None and sidebar["width"] > 200
    _screenshot(page, f"{page_name}-1280x800-sidebar")
    for selector in WHOLE_CELLS[page_name]:
        assert _cut(page, selector) == [], selector
    text = page.inner_text("#result_list")
    assert re.search(r"\b1234567\d\b", text), "an 8-digit id"
    assert "emails" in text and "send_welcome_email" in text
    # Times are relative, the exact time on hover.
    when = page.locator("#result_list .dbw-when").first
    assert when.inner_text().endswith(" ago")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d.*", when.get_attribute("title") or "")
    if page_name == "claimedworkitem":
        assert "cancel requested" in page.inner_text("td.field-status_badge")


def test_select_all_matching_rows_confirms_then_retries_them_all(  # type: ignore[no-untyped-def]
    browser_page,  # noqa: F811
    live_server,
) -> None:
    """More rows than a page: "Select all", Go, a confirmation page with the count, Yes."""
    WorkItem.objects.bulk_create(
        WorkItem(
            handler="echo",
            queue="emails",
            payload={},
            status=Status.FAILED,
            attempts=3,
            max_attempts=3,
            last_error=f"SMTPRecipientsRefused: user{i}@example.com",
        )
        for i in range(60)
    )
    other = make_item(handler="echo", queue="default", status=Status.FAILED, attempts=3)
    page = browser_page
    _log_in(page, f"{live_server.url}/admin/django_dbworker/failedworkitem/?queue=emails")
    page.check("#action-toggle")
    page.click(".actions .question a")
    assert "All matching failed work items selected (60)" in page.inner_text(".actions")
    page.select_option("select[name=action]", "retry")
    page.click("button[name=index]")
    page.wait_for_selector("#dbw-confirm")
    assert page.inner_text("#dbw-confirm-filters") == "queue = emails"
    assert page.inner_text("#dbw-confirm-eligible") == "60"
    assert WorkItem.objects.filter(status=Status.FAILED).count() == 61  # nothing yet
    _screenshot(page, "select-all-confirmation-1280x800")
    page.click("#dbw-confirm-yes")
    page.wait_for_selector("ul.messagelist")
    assert "60 work item(s) set to pending" in page.inner_text("ul.messagelist")
    assert WorkItem.objects.filter(queue="emails", status=Status.PENDING).count() == 60
    assert WorkItem.objects.get(pk=other.pk).status == Status.FAILED


def test_the_retry_button_of_a_rows_page(  # type: ignore[no-untyped-def]
    browser_page,  # noqa: F811
    live_server,
) -> None:
    item = make_item(
        handler="echo",
        status=Status.FAILED,
        attempts=3,
        claimed_by="old-host:1:MainThread",
        last_error="ValueError: the report broke",
    )
    page = browser_page
    _log_in(page, f"{live_server.url}/admin/django_dbworker/failedworkitem/")
    page.goto(f"{live_server.url}/admin/django_dbworker/failedworkitem/{item.pk}/change/")
    assert page.locator("button.dbw-row-action").all_inner_texts() == ["RETRY"]
    assert "old-host" not in page.content()
    _screenshot(page, "failed-row-page-1280x800")
    page.click("button.dbw-row-action[value=retry]")
    page.wait_for_selector("ul.messagelist")
    assert "1 work item(s) set to pending for a new run." in page.inner_text("ul.messagelist")
    assert page.url.endswith(f"/admin/django_dbworker/workitem/{item.pk}/change/")
    assert page.locator("button.dbw-row-action").all_inner_texts() == ["CANCEL", "RUN NOW"]
    assert WorkItem.objects.get(pk=item.pk).status == Status.PENDING


def test_a_pending_rows_page_offers_cancel_and_run_now(  # type: ignore[no-untyped-def]
    browser_page,  # noqa: F811
    live_server,
) -> None:
    item = make_item(handler="echo", claimed_by="old-host:1:MainThread")
    page = browser_page
    _log_in(page, f"{live_server.url}/admin/django_dbworker/workitem/")
    page.goto(f"{live_server.url}/admin/django_dbworker/workitem/{item.pk}/change/")
    _screenshot(page, "pending-row-page-1280x800")
    boxes = [b.bounding_box() for b in page.locator(".object-tools li").all()]
    # The two buttons sit in one row (no History link: admin edits make no item's story).
    assert len(boxes) == 2 and all(b is not None for b in boxes)
    assert len({round(b["y"]) for b in boxes if b}) == 1
    page.click("button.dbw-row-action[value=run_now]")
    page.wait_for_selector("ul.messagelist")
    assert "1 work item(s) made due now." in page.inner_text("ul.messagelist")


def test_the_dashboard_groups_failures_whose_messages_carry_ids(  # type: ignore[no-untyped-def]
    browser_page,  # noqa: F811
    live_server,
) -> None:
    for order in (1234, 99, 500_001, 7):
        item = make_item(
            handler="echo",
            status=Status.FAILED,
            attempts=3,
            last_error=f"LookupError: Order {order} not found\n\nTraceback ...",
        )
        WorkItem.objects.filter(pk=item.pk).update(claimed_at=Now(), finished_at=Now())
    page = browser_page
    User.objects.create_superuser("admin", "admin@example.com", "s3cret-pass")
    page.set_viewport_size({"width": WIDTH, "height": HEIGHT})
    page.goto(f"{live_server.url}/admin/django_dbworker/queuesummary/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", "s3cret-pass")
    page.click("input[type=submit]")
    page.wait_for_selector("#dbw-failures")
    rows = page.locator("#dbw-failures tbody tr")
    assert rows.count() == 1
    assert rows.first.inner_text().split("\t")[:3] == [
        "LookupError: Order <n> not found",
        "echo",
        "4",
    ]
    page.locator("#dbw-failures").scroll_into_view_if_needed()
    _screenshot(page, "dashboard-failures-1280x800")
