from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from django_dbworker.admin.display import age, duration, first_line, trace_id


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
