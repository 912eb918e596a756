"""The Batches page in a real Chromium at 1280 px: progress bars, counts, callbacks.

``DBWORKER_SCREENSHOTS=1 pytest tests/e2e -k batches`` writes the picture of
the docs and the issue's closing note, ``docs/img/batches-page.png``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from django.contrib.auth.models import User

from django_dbworker import batch
from django_dbworker.batches.models import Batch
from django_dbworker.models import Status, WorkItem
from django_dbworker.testing import run_until_empty
from tests.e2e.test_admin_browser import browser_page  # noqa: F401  (the fixture)
from tests.factories import claim
from tests.testapp.workers import BatchDone, Echo, Noop, NoRetry

pytestmark = pytest.mark.django_db(transaction=True)

WIDTH, HEIGHT = 1280, 800


def _seed() -> dict[str, Batch]:
    """A finished batch whose callback ran, one complete with failures, two in progress."""
    with batch(on_complete=BatchDone, payload={"report": "daily"}) as done:
        Noop.enqueue_many([{}] * 12)
    with batch(on_complete=BatchDone, payload={"import_id": 7}) as failed:
        Noop.enqueue_many([{}] * 46)
        NoRetry.enqueue_many([{"row": 17}, {"row": 31}])
    run_until_empty([Noop, NoRetry, BatchDone])  # the first batch's callback runs too
    with batch(on_complete=BatchDone, payload={"import_id": 8}) as running:
        Noop.enqueue_many([{}] * 30)
        Echo.enqueue_many([{"row": n} for n in range(50)])
    with batch(on_complete=BatchDone, payload={"export": "eu"}) as started:
        Echo.enqueue_many([{"row": n} for n in range(20)])
    run_until_empty([Noop])
    claim(limit=6, handlers=["echo"], worker="web-1:4242:MainThread")
    some = WorkItem.objects.filter(batch_id=started.pk, status=Status.PENDING).order_by("pk")
    some.filter(pk__in=list(some.values_list("pk", flat=True)[:3])).cancel_pending()
    return {"done": done, "failed": failed, "running": running, "started": started}


def test_the_batches_page_shows_each_batchs_progress_at_1280_px(  # type: ignore[no-untyped-def]
    browser_page,  # noqa: F811
    live_server,
) -> None:
    User.objects.create_superuser("admin", "admin@example.com", "s3cret-pass")
    made = _seed()
    page = browser_page
    page.set_viewport_size({"width": WIDTH, "height": HEIGHT})
    page.goto(f"{live_server.url}/admin/django_dbworker/batch/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", "s3cret-pass")
    page.click("input[type=submit]")
    page.wait_for_selector("#result_list")
    rows = {
        name: page.locator(f"#result_list tr:has(a[href$='/batch/{b.pk}/change/'])")
        for name, b in made.items()
    }
    failed = rows["failed"].inner_text()
    assert "48 items" in failed and "46 succeeded" in failed and "2 failed" in failed
    assert "completed" in failed
    running = rows["running"].inner_text()
    assert "80 items" in running and "30 succeeded" in running and "running" in running
    assert "open" in running
    # Each bar is drawn, at a width that follows the counts, and on screen.
    for name in made:
        bar = rows[name].locator(".dbw-bar")
        box = bar.bounding_box()
        assert box is not None and box["width"] > 100 and box["x"] + box["width"] <= WIDTH, name
    ok = rows["failed"].locator(".dbw-seg-succeeded").bounding_box()
    bad = rows["failed"].locator(".dbw-seg-failed").bounding_box()
    assert ok is not None and bad is not None and ok["width"] > 10 * bad["width"] > 0
    # The callback's item links to its row; its state is shown beside it.
    callback = made["done"].pk
    done = Batch.objects.get(pk=callback)
    link = rows["done"].locator(f"a[href$='/workitem/{done.callback_id}/change/']")
    assert link.count() == 1 and "succeeded" in rows["done"].inner_text()
    cells = rows["running"].locator("td, th")
    last = cells.nth(cells.count() - 1).bounding_box()
    assert last is not None and last["x"] + last["width"] <= WIDTH
    if os.environ.get("DBWORKER_SCREENSHOTS"):
        page.screenshot(path=str(Path(__file__).resolve().parents[2] / "docs/img/batches-page.png"))
    # The items link opens the Work items list filtered by the batch.
    rows["failed"].get_by_text("48 items").click()
    page.wait_for_selector("#result_list")
    assert f"batch={made['failed'].pk}" in page.url
    assert page.locator("#result_list tbody tr").count() == 48
