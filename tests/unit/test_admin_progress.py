"""The Batches page's bar and counts, and the short times of its columns (no database)."""

from __future__ import annotations

import html as html_lib
import re
from datetime import timedelta

import pytest
from django.utils import timezone
from django.utils.html import strip_tags

from django_dbworker.admin.display import short_timestamp
from django_dbworker.admin.progress import progress_bar
from django_dbworker.batches.stats import Progress


def _widths(html: str) -> dict[str, float]:
    return {
        name: float(width)
        for name, width in re.findall(r'dbw-seg-(\w+)" style="width:([\d.]+)%', html)
    }


def _words(html: str) -> str:
    return html_lib.unescape(strip_tags(html)).replace("\xa0", " ")


def test_an_open_batch_shows_each_state_and_its_running_items() -> None:
    html = progress_bar(Progress(total=10, succeeded=4, failed=1, pending=5, claimed=2))
    assert _widths(html) == {"succeeded": 40.0, "failed": 10.0, "claimed": 20.0, "queued": 30.0}
    words = _words(html)
    assert words == "10 items · 4 succeeded · 1 failed · 0 cancelled · 5 pending (2 running)"


def test_a_completed_batch_shows_its_stored_counts_and_what_was_retried_since() -> None:
    html = progress_bar(Progress(total=3, succeeded=2, failed=1, pending=1, completed=True))
    assert _widths(html) == pytest.approx({"succeeded": 66.67, "failed": 33.33})
    words = _words(html)
    assert words == "3 items · 2 succeeded · 1 failed · 0 cancelled · 1 retried since"


def test_an_empty_batch_and_one_with_gone_items() -> None:
    assert _widths(progress_bar(Progress(total=0, completed=True))) == {}
    assert "0 items" in strip_tags(progress_bar(Progress(total=0, completed=True)))
    html = progress_bar(Progress(total=4, succeeded=1, pending=1))
    assert "2 gone" in strip_tags(html) and _widths(html) == {"succeeded": 25.0, "queued": 25.0}
    assert "1 item ·" in _words(progress_bar(Progress(total=1, pending=1)))


def test_the_items_link_wraps_the_total() -> None:
    html = progress_bar(Progress(total=2, pending=2), items="/admin/x/?batch=3")
    assert '<a href="/admin/x/?batch=3"><strong>2</strong> items</a>' in html


def test_short_times_say_the_time_today_and_the_date_before() -> None:
    now = timezone.now()
    today = strip_tags(short_timestamp(now))
    assert today == timezone.localtime(now).strftime("%H:%M:%S")
    before = strip_tags(short_timestamp(now - timedelta(days=3)))
    assert before == timezone.localtime(now - timedelta(days=3)).strftime("%Y-%m-%d")
    assert short_timestamp(None) == "-"
