"""The admin in a real headless Chromium: log in, open Failed, Retry a row.

Uses Debian's ``chromium`` (installed by scripts/test) driven by Playwright
from PyPI; no browser is downloaded.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from django.contrib.auth.models import User

from django_dbworker.models import Status, WorkItem
from tests.factories import make_item

pytestmark = pytest.mark.django_db(transaction=True)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _browser_or_reason() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e .[dev])"
    if not Path(CHROMIUM).exists():
        return "Debian's chromium is not installed (scripts/test installs it as root)"
    return None


@pytest.fixture
def browser_page(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    reason = _browser_or_reason()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"browser test cannot run in CI: {reason}")
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop on this thread; the test's own
    # ORM calls are ordinary synchronous ones.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        try:
            yield page
        finally:
            page.screenshot(path=str(tmp_path / "last-page.png"))
            browser.close()


def test_retry_a_failed_row_from_the_failed_page(browser_page, live_server) -> None:  # type: ignore[no-untyped-def]
    User.objects.create_superuser("admin", "admin@example.com", "s3cret-pass")
    failed = make_item(
        handler="noop",
        status=Status.FAILED,
        attempts=3,
        last_error="ValueError: the report broke\n\nTraceback ...",
    )
    other = make_item(handler="echo", status=Status.FAILED, attempts=3, last_error="KeyError: x")
    page = browser_page
    page.goto(f"{live_server.url}/admin/django_dbworker/failedworkitem/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", "s3cret-pass")
    page.click("input[type=submit]")
    page.wait_for_selector("#result_list")
    assert "ValueError: the report broke" in page.content()
    page.check(f"input[name=_selected_action][value='{failed.pk}']")
    page.select_option("select[name=action]", "retry")
    page.click("button[name=index]")
    page.wait_for_selector("ul.messagelist")
    assert "1 work item(s) set to pending" in page.inner_text("ul.messagelist")
    # The retried row left the Failed page; the other one is still there.
    assert f"/failedworkitem/{failed.pk}/change/" not in page.content()
    assert f"/failedworkitem/{other.pk}/change/" in page.content()
    row = WorkItem.objects.get(pk=failed.pk)
    assert (row.status, row.attempts) == (Status.PENDING, 0)
    assert WorkItem.objects.get(pk=other.pk).status == Status.FAILED


def test_schedules_page_shows_schedules_and_runs_one_now(browser_page, live_server) -> None:  # type: ignore[no-untyped-def]
    from datetime import UTC, datetime

    from django_dbworker.worker.scheduler import ensure_schedules, take_slot
    from tests.testapp.workers import Nightly

    User.objects.create_superuser("admin", "admin@example.com", "s3cret-pass")
    ensure_schedules(["nightly", "tick", "slow_tick"], using="default")
    take_slot(Nightly, datetime(2024, 5, 1, 1, 0, tzinfo=UTC), using="default")
    WorkItem.objects.filter(handler="nightly").update(status=Status.SUCCEEDED)
    page = browser_page
    page.goto(f"{live_server.url}/admin/django_dbworker/periodicschedule/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", "s3cret-pass")
    page.click("input[type=submit]")
    page.wait_for_selector("#dbw-schedules")
    nightly = page.inner_text("tr[data-name=nightly]")
    assert "at 03:00 every day (Europe/Paris)" in nightly
    assert "succeeded" in nightly
    assert "every second" in page.inner_text("tr[data-name=tick]")
    if os.environ.get("DBWORKER_SCREENSHOTS"):
        # The README's picture: DBWORKER_SCREENSHOTS=1 pytest tests/e2e -k schedules
        page.screenshot(
            path=str(Path(__file__).resolve().parents[2] / "docs/img/schedules-page.png")
        )
    page.click("tr[data-name=nightly] input[type=submit]")
    page.wait_for_selector("ul.messagelist")
    assert "Enqueued an extra run of nightly" in page.inner_text("ul.messagelist")
    assert WorkItem.objects.filter(handler="nightly", payload__manual=True).count() == 1


def _seed_an_hour_of_work() -> None:
    """Four queues' last hour: steady work, a burst, kinds of failure, lag, a stale claim."""
    import random
    from datetime import timedelta

    from django.db.models.functions import Now

    from tests.factories import age_heartbeat, claim

    probe = make_item(handler="noop", status=Status.CANCELLED)
    now = WorkItem.objects.annotate(now=Now()).values_list("now", flat=True).get(pk=probe.pk)
    probe.delete()
    rng = random.Random(14)
    # queue: (handler, successes per minute, median run time in s, failure rate, errors)
    queues = {
        "default": ("echo", 9, 0.4, 0.02, ["KeyError: 'user_id'"]),
        "emails": (
            "record",
            5,
            1.8,
            0.08,
            ["SMTPServerDisconnected: Connection unexpectedly closed"],
        ),
        "images": (
            "slow",
            2,
            12.0,
            0.15,
            ["MemoryError", "OSError: [Errno 28] No space left on device"],
        ),
        "reports": ("flaky", 1, 40.0, 0.05, ["TimeoutError: work item ran longer than 60 s"]),
    }
    rows = []
    for minute in range(60):
        for queue, (handler, rate, median, fail_rate, errors) in queues.items():
            burst = 3 if queue == "emails" and 20 <= minute < 26 else 1
            for _ in range(max(0, round(rng.gauss(rate * burst, rate / 3)))):
                finished = now - timedelta(minutes=minute, seconds=rng.uniform(0, 59))
                run = median * rng.lognormvariate(0, 0.5)
                failed = rng.random() < fail_rate
                rows.append(
                    WorkItem(
                        handler=handler,
                        queue=queue,
                        payload={},
                        status=Status.FAILED if failed else Status.SUCCEEDED,
                        attempts=3 if failed else 1,
                        max_attempts=3,
                        claimed_at=finished - timedelta(seconds=run),
                        finished_at=finished,
                        last_error=(rng.choice(errors) + "\n\nTraceback ...") if failed else "",
                    )
                )
    WorkItem.objects.bulk_create(rows)
    for queue, waiting in (("default", 4), ("emails", 37), ("images", 12)):
        for i in range(waiting):
            make_item(
                handler=queues[queue][0],
                queue=queue,
                run_after=now - timedelta(seconds=5 + i * (9 if queue == "emails" else 2)),
            )
    claimed = claim(limit=6, handlers=["echo", "record", "slow"], worker="web-1:4242:MainThread")
    age_heartbeat(claimed[0], 300)


def test_dashboard_shows_the_last_hour_and_refreshes_itself(browser_page, live_server) -> None:  # type: ignore[no-untyped-def]
    User.objects.create_superuser("admin", "admin@example.com", "s3cret-pass")
    _seed_an_hour_of_work()
    page = browser_page
    page.set_viewport_size({"width": 1280, "height": 800})
    page.goto(f"{live_server.url}/admin/django_dbworker/queuesummary/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", "s3cret-pass")
    page.click("input[type=submit]")
    page.wait_for_selector("#dbw-throughput")
    # One chart per queue, one bar per minute, drawn at its size.
    for queue in ("default", "emails", "images", "reports"):
        chart = page.locator(f"tr[data-queue={queue}] svg.dbw-chart")
        assert chart.locator("g.dbw-bar").count() == 60
        box = chart.bounding_box()
        assert box is not None and box["width"] > 400 and box["height"] == 40
    assert page.locator("#dbw-run-times tr[data-handler=slow]").count() == 1
    assert "OSError: [Errno 28] No space left on device" in page.inner_text("#dbw-failures")
    if os.environ.get("DBWORKER_SCREENSHOTS"):
        # The README's picture: DBWORKER_SCREENSHOTS=1 pytest tests/e2e -k dashboard
        # The whole page, as a 1280 px wide window shows it when scrolled through.
        page.screenshot(
            path=str(Path(__file__).resolve().parents[2] / "docs/img/dashboard.png"),
            full_page=True,
        )
    # The page re-fetches itself: a failure recorded now shows up without a reload.
    first = page.inner_text("#dbw-updated-at")
    latest = (
        WorkItem.objects.filter(finished_at__isnull=False)
        .order_by("-finished_at")
        .values_list("finished_at", flat=True)[0]
    )
    make_item(
        handler="echo",
        status=Status.FAILED,
        attempts=3,
        last_error="RuntimeError: failed after the page was opened",
        claimed_at=latest,
        finished_at=latest,
    )
    # Bounded: the page refreshes every 5 s; fail after four refreshes' worth.
    page.wait_for_function(
        "(document.getElementById('dbw-failures') || {textContent: ''})"
        ".textContent.includes('failed after the page was opened')",
        timeout=20_000,
    )
    assert page.inner_text("#dbw-updated-at") != first
    assert page.locator("#dbw-refresh-stopped").is_hidden()


def test_the_work_items_list_shows_each_error_at_1280_px(browser_page, live_server) -> None:  # type: ignore[no-untyped-def]
    """The error, the status and where each row stands are on screen without scrolling."""
    User.objects.create_superuser("admin", "admin@example.com", "s3cret-pass")
    make_item(
        handler="noop",
        status=Status.FAILED,
        attempts=3,
        last_error="ValueError: the export references a column that does not exist any more\n...",
    )
    claimed = make_item(handler="echo", status=Status.CLAIMED, claimed_by="web-1:4242:MainThread")
    page = browser_page
    page.goto(f"{live_server.url}/admin/django_dbworker/workitem/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", "s3cret-pass")
    page.click("input[type=submit]")
    page.wait_for_selector("#result_list")
    width = page.viewport_size["width"]
    for text in ("ValueError: the export", "web-1:4242", "failed", "claimed"):
        box = page.get_by_text(text, exact=False).first.bounding_box()
        assert box is not None and box["x"] + min(box["width"], 200) <= width, (text, box)
    # The whole error on hover.
    title = page.get_by_text("ValueError: the export").first.get_attribute("title")
    assert title == "ValueError: the export references a column that does not exist any more"
    assert claimed.pk


def test_queues_page_pauses_and_resumes_a_queue(browser_page, live_server) -> None:  # type: ignore[no-untyped-def]
    from django_dbworker import pause_queue
    from django_dbworker.flow.models import QueueState

    User.objects.create_superuser("admin", "admin@example.com", "s3cret-pass")
    for queue, pending in (("default", 12), ("emails", 40), ("reports", 3)):
        for _ in range(pending):
            make_item(handler="noop", queue=queue)
    make_item(handler="noop", queue="emails", status=Status.CLAIMED)
    pause_queue("reports", by="ops@example.com")
    page = browser_page
    page.goto(f"{live_server.url}/admin/django_dbworker/queuestate/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", "s3cret-pass")
    page.click("input[type=submit]")
    page.wait_for_selector("#dbw-queues")
    assert "paused" in page.inner_text("tr[data-name=reports]")
    assert "ops@example.com" in page.inner_text("tr[data-name=reports]")
    page.click("tr[data-name=emails] input[type=submit]")
    page.wait_for_selector("ul.messagelist")
    assert "Paused queue 'emails'" in page.inner_text("ul.messagelist")
    assert QueueState.objects.get(name="emails").paused_by == "admin"
    emails = page.inner_text("tr[data-name=emails]")
    assert "paused" in emails and "40" in emails and "admin" in emails
    if os.environ.get("DBWORKER_SCREENSHOTS"):
        # The picture: DBWORKER_SCREENSHOTS=1 pytest tests/e2e -k queues
        page.screenshot(path=str(Path(__file__).resolve().parents[2] / "docs/img/queues-page.png"))
    page.click("tr[data-name=reports] input[type=submit]")
    page.wait_for_selector("ul.messagelist")
    assert "Resumed queue 'reports'" in page.inner_text("ul.messagelist")
    assert not QueueState.objects.get(name="reports").paused
