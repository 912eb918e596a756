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
