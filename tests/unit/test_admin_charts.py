"""The dashboard's chart geometry: bars per minute, scaled to the busiest one."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django_dbworker.admin import charts

MINUTES = [datetime(2024, 5, 1, 14, 0, tzinfo=UTC) + timedelta(minutes=i) for i in range(4)]


def test_the_busiest_minute_fills_the_height_and_failures_sit_on_top() -> None:
    chart = charts.throughput_chart(MINUTES, [(0, 0), (30, 10), (10, 0), (1, 0)])
    assert (chart.peak, chart.succeeded, chart.failed) == (40, 41, 10)
    empty, busy, quarter, one = chart.bars
    assert (empty.succeeded_height, empty.failed_height) == (0, 0)
    assert (busy.succeeded_height, busy.failed_height) == (30, 10)
    assert busy.failed_y + busy.failed_height == busy.succeeded_y
    assert busy.succeeded_y + busy.succeeded_height == charts.CHART_HEIGHT
    assert quarter.succeeded_height == 10
    assert one.succeeded_height == 1  # one row among many still shows
    assert [bar.x for bar in chart.bars] == [0, 8, 16, 24]
    assert chart.width == 4 * 8 - 2
    assert busy.minute_iso == "2024-05-01T14:01"


def test_a_single_failure_among_many_successes_is_visible() -> None:
    (bar,) = charts.throughput_chart(MINUTES[:1], [(999, 1)]).bars
    assert bar.failed_height == 1 and bar.succeeded_height == charts.CHART_HEIGHT - 1
    assert bar.failed_y == 0


def test_totals_may_cover_more_than_the_bars() -> None:
    chart = charts.throughput_chart(MINUTES[:1], [(2, 1)], totals=(5, 3))
    assert (chart.succeeded, chart.failed) == (5, 3)


def test_run_time_bars_scale_to_the_longest_p95() -> None:
    assert charts.run_time_widths(1.0, 4.0, 8.0) == (20, 80)
    assert charts.run_time_widths(0.0001, 8.0, 8.0) == (1, charts.RUN_TIME_WIDTH)
    assert charts.run_time_widths(0.0, 0.0, 0.0) == (0, 0)
