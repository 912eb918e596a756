"""Pictures for the dashboard, as geometry for inline SVG: no JavaScript, no build step.

Turns numbers from ``stats`` into rectangles (positions and sizes in
pixels); the template writes them out as ``<svg>`` elements. Reads nothing
from the database and knows nothing of HTML escaping: every value it
produces is a number or a label the template escapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from django.utils import timezone

from django_dbworker.admin.display import STATUS_COLOURS

#: One bar per minute: its width and the gap after it, and the chart's height.
BAR_WIDTH = 6
BAR_GAP = 2
CHART_HEIGHT = 40
#: Width of the run-time bars (p50 inside p95), for the longest p95 shown.
RUN_TIME_WIDTH = 160

SUCCEEDED_COLOUR = STATUS_COLOURS["succeeded"]
FAILED_COLOUR = STATUS_COLOURS["failed"]


@dataclass(frozen=True)
class Bar:
    """One minute: succeeded rows stacked under failed ones."""

    minute: datetime
    succeeded: int
    failed: int
    x: int
    succeeded_y: int
    succeeded_height: int
    failed_y: int
    failed_height: int

    @property
    def minute_iso(self) -> str:
        """The minute in UTC, ``2024-05-01T14:03``: stable for tests and tooltips' hover."""
        return self.minute.strftime("%Y-%m-%dT%H:%M")

    @property
    def label(self) -> str:
        local = timezone.localtime(self.minute).strftime("%H:%M")
        return f"{local}: {self.succeeded} succeeded, {self.failed} failed"


@dataclass(frozen=True)
class ThroughputChart:
    bars: list[Bar]
    width: int
    height: int
    #: The busiest minute's total, which is the chart's full height.
    peak: int
    succeeded: int
    failed: int


def throughput_chart(
    minutes: Sequence[datetime],
    counts: Sequence[tuple[int, int]],
    totals: tuple[int, int] | None = None,
) -> ThroughputChart:
    """Stacked bars, one per minute, scaled so that the busiest minute fills the height.

    ``totals`` (succeeded, failed) default to the sums of ``counts``.

    A minute with any rows gets at least one pixel per status present, so a
    single failure among hundreds of successes still shows.
    """
    peak = max((s + f for s, f in counts), default=0)
    bars = []
    for i, (minute, (succeeded, failed)) in enumerate(zip(minutes, counts, strict=True)):
        failed_height = _scaled(failed, peak, CHART_HEIGHT)
        # Rounding up both parts may overshoot the full height by a pixel.
        succeeded_height = min(_scaled(succeeded, peak, CHART_HEIGHT), CHART_HEIGHT - failed_height)
        bars.append(
            Bar(
                minute=minute,
                succeeded=succeeded,
                failed=failed,
                x=i * (BAR_WIDTH + BAR_GAP),
                succeeded_y=CHART_HEIGHT - succeeded_height,
                succeeded_height=succeeded_height,
                failed_y=CHART_HEIGHT - succeeded_height - failed_height,
                failed_height=failed_height,
            )
        )
    return ThroughputChart(
        bars=bars,
        width=len(minutes) * (BAR_WIDTH + BAR_GAP) - BAR_GAP,
        height=CHART_HEIGHT,
        peak=peak,
        succeeded=totals[0] if totals else sum(s for s, _ in counts),
        failed=totals[1] if totals else sum(f for _, f in counts),
    )


def _scaled(value: int, peak: int, size: int) -> int:
    if value <= 0 or peak <= 0:
        return 0
    return max(1, round(size * value / peak))


def run_time_widths(p50: float, p95: float, longest: float) -> tuple[int, int]:
    """Widths in pixels of the p50 and p95 bars, the longest p95 shown being full width."""
    if longest <= 0:
        return (0, 0)
    return (
        max(1, round(RUN_TIME_WIDTH * p50 / longest)),
        max(1, round(RUN_TIME_WIDTH * p95 / longest)),
    )
