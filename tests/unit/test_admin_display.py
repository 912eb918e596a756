from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone
from django.utils.html import strip_tags

from django_dbworker.admin.display import (
    age,
    duration,
    error_history,
    first_line,
    pretty_json,
    relative_time,
    timestamp,
    trace_id,
    worker,
)
from django_dbworker.admin.jsontext import PRETTY_MAX_CHARS, bounded_json


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


def test_list_times_are_relative_with_the_exact_time_on_hover() -> None:
    """Short enough for a list column at 1,280 px beside the sidebar; which second on hover."""
    when = datetime(2026, 11, 30, 19, 3, 12, 345678, tzinfo=UTC)
    with timezone.override("Europe/Berlin"):
        html = relative_time(when, when + timedelta(minutes=12, seconds=30))
        without_clock = relative_time(when, None)
    assert strip_tags(html) == "12m 30s ago"
    assert 'title="2026-11-30 20:03:12 CET"' in html
    # No database clock (a row not read through the list's query): the exact time.
    assert strip_tags(without_clock) == "2026-11-30 20:03:12"
    assert relative_time(None, when) == "-"


@pytest.mark.parametrize(
    "value",
    [
        {},
        [],
        0,
        1.5,
        "é <b>",
        None,
        True,
        [[[]], {}],
        {"b": [1, {"c": {}}], "a": "x", "é": None},
        {"x": [1, 2, [3, {"y": [None, "z"]}]]},
    ],
)
def test_bounded_json_is_json_dumps_for_ordinary_values(value: Any) -> None:
    expected = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)
    assert bounded_json(value) == (expected, False)


def test_bounded_json_writes_levels_past_the_depth_limit_on_one_line() -> None:
    value: Any = {"a": 1}
    for _ in range(4):
        value = [value, 2]
    text, truncated = bounded_json(value, max_depth=2)
    assert not truncated and json.loads(text) == value
    assert text == '[\n  [\n    [[{"a": 1}, 2], 2],\n    2\n  ],\n  2\n]'


def test_bounded_json_neither_recurses_nor_reads_past_its_bound() -> None:
    deep: Any = "leaf"
    for _ in range(100_000):  # far past Python's recursion limit
        deep = [deep]
    text, truncated = bounded_json(deep, max_chars=1_000)
    assert truncated and len(text) == 1_000
    text, truncated = bounded_json(deep, max_chars=10**6)
    assert not truncated and text.count("[") == 100_000
    text, truncated = bounded_json(list(range(10**6)), max_chars=500)
    assert truncated and len(text) == 500


def test_pretty_json_says_when_it_cut_and_links_the_raw_value() -> None:
    big = ["<x>" * 100] * 2_000
    html = pretty_json(big, raw_url="/raw/?a=1&b=2")
    assert "truncated" in html and 'href="/raw/?a=1&amp;b=2"' in html
    assert "<x>" not in html and "&lt;x&gt;" in html
    assert len(strip_tags(html)) < PRETTY_MAX_CHARS * 6
    assert "truncated" in pretty_json(big) and "href" not in pretty_json(big)
    assert "truncated" not in pretty_json({"small": 1}, raw_url="/raw/")


def test_error_history_shows_the_newest_entries_each_bounded() -> None:
    history = [{"attempt": n, "error": f"E{n} " + "x" * 50_000} for n in range(100)]
    html = error_history(history)
    assert "E99 " in html and "E0 " not in html
    assert "(75 older attempts not shown)" in html
    assert len(html) < 25 * 11_000 + 10_000
