from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone
from django.utils.html import strip_tags

from django_dbworker.admin.display import (
    age,
    duration,
    first_line,
    timestamp,
    trace_id,
    worker,
)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (4.4, "4s"),
        (60, "1m"),
        (200, "3m 20s"),
        (7500, "2h 5m"),
        (273600, "3d 4h"),
        (-90, "1m 30s"),
    ],
)
def test_duration(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_age_is_relative_to_the_given_clock() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert age(now - timedelta(seconds=5), now) == "5s ago"
    assert age(now + timedelta(minutes=2, seconds=10), now) == "in 2m 10s"
    assert age(None, now) == "-"


def test_first_line_and_trace_id() -> None:
    assert first_line("ValueError: x\n\nTraceback") == "ValueError: x"
    assert first_line("a" * 500, limit=10) == "a" * 9 + "…"
    assert trace_id({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}) == (
        "0af7651916cd43dd8448eb211c80319c"
    )
    assert trace_id({}) is None and trace_id(None) is None


@pytest.mark.parametrize(
    ("claimed_by", "shown"),
    [
        ("web-1:4242:MainThread", "web-1:4242"),  # run_workers claims on its main thread
        ("web-1:4242:Thread-3", "web-1:4242 (Thread-3)"),  # an in-process worker's thread
        ("host.example.com:17:dbworker-2", "host.example.com:17 (dbworker-2)"),
        ("no-colons", "no-colons"),
        ("", "-"),
    ],
)
def test_worker_shows_host_and_pid_and_the_thread_only_when_it_says_something(
    claimed_by: str, shown: str
) -> None:
    assert strip_tags(worker(claimed_by)) == shown
    if claimed_by:
        assert f'title="{claimed_by}"' in worker(claimed_by)


def test_timestamps_show_seconds_in_the_current_time_zone() -> None:
    when = datetime(2026, 11, 30, 19, 3, 12, 345678, tzinfo=UTC)
    with timezone.override("Europe/Berlin"):
        html = timestamp(when)
    assert strip_tags(html) == "2026-11-30 20:03:12"
    assert "2026-11-30T20:03:12.345678+01:00" in html
    assert timestamp(None) == "-"
