"""``Snooze(seconds)`` refuses bad delays when it is raised, with a message that says why."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

import django_dbworker
from django_dbworker.errors import MAX_SNOOZE_SECONDS, Cancelled, Snooze


def test_the_package_exports_snooze_and_cancelled() -> None:
    assert django_dbworker.Snooze is Snooze
    assert django_dbworker.Cancelled is Cancelled
    assert {"Snooze", "Cancelled"} <= set(django_dbworker.__all__)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(0, 0.0), (1.5, 1.5), (600, 600.0), (timedelta(minutes=2), 120.0), (timedelta(0), 0.0)],
)
def test_numbers_and_timedeltas(value: float | timedelta, seconds: float) -> None:
    assert Snooze(value).seconds == seconds


@pytest.mark.parametrize("value", ["5", None, True, [1], object()])
def test_not_a_number_is_a_type_error(value: object) -> None:
    with pytest.raises(TypeError, match="seconds must be a number or a timedelta"):
        Snooze(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-1, -0.5, math.nan, timedelta(seconds=-1)])
def test_negative_or_nan_is_a_value_error(value: float | timedelta) -> None:
    with pytest.raises(ValueError, match="seconds must be 0 or more"):
        Snooze(value)


@pytest.mark.parametrize("value", [math.inf, 1e300, timedelta(days=999_999)])
def test_a_huge_delay_is_cut_to_ten_years(value: float | timedelta) -> None:
    assert Snooze(value).seconds == MAX_SNOOZE_SECONDS == 10 * 365 * 86400.0


def test_cancelled_can_be_raised_with_a_message() -> None:
    with pytest.raises(Cancelled, match="no longer needed"):
        raise Cancelled("no longer needed")
    assert str(Snooze(3)) == "snoozed for 3s"


def test_snooze_of_an_int_too_big_for_a_float_is_cut_to_ten_years() -> None:
    """``Snooze(2**1024)``: ``float()`` of it would raise ``OverflowError``; it is cut, as
    documented, and a negative one of that size is the usual ``ValueError``."""
    assert Snooze(2**1024).seconds == MAX_SNOOZE_SECONDS
    with pytest.raises(ValueError, match="seconds must be 0 or more"):
        Snooze(-(2**1024))
