"""Schedule maths of periodic handlers with a fixed clock: intervals, cron, DST, words."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from django_dbworker.periodic.schedules import (
    CronSchedule,
    IntervalSchedule,
    InvalidSchedule,
    make_schedule,
    parse_slot,
    slot_key,
)

BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")


def at(*args: int, tz: object = UTC) -> datetime:
    return datetime(*args, tzinfo=tz)  # type: ignore[arg-type]


def slots(schedule: IntervalSchedule | CronSchedule, start: datetime, n: int) -> list[datetime]:
    found, t = [], start
    for _ in range(n):
        t = schedule.following(t)
        assert t is not None
        found.append(t)
    return found


# -- intervals ----------------------------------------------------------------------


def test_interval_slots_are_aligned_to_the_epoch_whatever_the_start() -> None:
    hourly = make_schedule(every=3600)
    assert hourly.latest(at(2024, 5, 1, 10, 59, 59)) == at(2024, 5, 1, 10)
    assert hourly.latest(at(2024, 5, 1, 11)) == at(2024, 5, 1, 11)  # a slot is its own latest
    assert hourly.following(at(2024, 5, 1, 11)) == at(2024, 5, 1, 12)  # strictly after
    assert hourly.following(at(2024, 5, 1, 10, 30, tz=BERLIN)) == at(2024, 5, 1, 9)


def test_interval_with_fractions_and_microseconds() -> None:
    every = make_schedule(every=1.5)
    t = at(2024, 1, 1) + timedelta(microseconds=1)
    assert every.latest(t) == at(2024, 1, 1)
    assert every.following(t) == at(2024, 1, 1) + timedelta(seconds=1.5)
    assert make_schedule(every=timedelta(minutes=5)).describe() == "every 5 minutes"


@pytest.mark.parametrize(
    ("seconds", "words"),
    [
        (1, "every second"),
        (1.5, "every 1.5 seconds"),
        (90, "every 90 seconds"),
        (60, "every minute"),
        (300, "every 5 minutes"),
        (3600, "every hour"),
        (7200, "every 2 hours"),
        (86400, "every day"),
    ],
)
def test_interval_in_words(seconds: float, words: str) -> None:
    assert make_schedule(every=seconds).describe() == words


# -- cron ---------------------------------------------------------------------------


def test_cron_in_utc() -> None:
    nightly = make_schedule(cron="0 3 * * *")
    assert nightly.describe() == "at 03:00 every day (UTC)"
    assert nightly.latest(at(2024, 5, 2, 2, 59)) == at(2024, 5, 1, 3)
    assert nightly.latest(at(2024, 5, 2, 3)) == at(2024, 5, 2, 3)
    assert nightly.latest(at(2024, 5, 2, 3, 0, 0) + timedelta(microseconds=5)) == at(2024, 5, 2, 3)
    assert nightly.following(at(2024, 5, 2, 3)) == at(2024, 5, 3, 3)


def test_cron_follows_the_wall_clock_of_its_timezone() -> None:
    nightly = make_schedule(cron="0 3 * * *", timezone="America/New_York")
    # 03:00 New York is 08:00 UTC in winter, 07:00 UTC in summer.
    assert nightly.following(at(2024, 1, 10)) == at(2024, 1, 10, 8)
    assert nightly.following(at(2024, 7, 10)) == at(2024, 7, 10, 7)
    assert nightly.describe() == "at 03:00 every day (America/New_York)"


def test_cron_in_a_skipped_hour_runs_once_right_after_the_change_like_debian_cron() -> None:
    # Berlin, 2024-03-31: 02:00 CET jumps to 03:00 CEST; 02:30 does not exist that day.
    job = make_schedule(cron="30 2 * * *", timezone="Europe/Berlin")
    found = slots(job, at(2024, 3, 29, 12), 4)
    assert [s.astimezone(BERLIN).isoformat() for s in found] == [
        "2024-03-30T02:30:00+01:00",
        "2024-03-31T03:00:00+02:00",  # once, right after the change
        "2024-04-01T02:30:00+02:00",
        "2024-04-02T02:30:00+02:00",
    ]
    # Backwards the same slots: each is the latest at its own instant and
    # the previous one a second earlier.
    for previous, slot in itertools.pairwise(found):
        assert job.latest(slot) == slot
        assert job.latest(slot - timedelta(seconds=1)) == previous


def test_cron_in_a_repeated_hour_runs_once_the_first_time_like_debian_cron() -> None:
    # Berlin, 2024-10-27: 03:00 CEST goes back to 02:00 CET; 02:30 happens twice.
    job = make_schedule(cron="30 2 * * *", timezone="Europe/Berlin")
    found = slots(job, at(2024, 10, 25, 12), 3)
    assert [s.astimezone(BERLIN).isoformat() for s in found] == [
        "2024-10-26T02:30:00+02:00",
        "2024-10-27T02:30:00+02:00",  # the first 02:30 only
        "2024-10-28T02:30:00+01:00",
    ]
    # During the second 02:30 (CET) the latest slot is still the first one.
    second = datetime(2024, 10, 27, 2, 45, tzinfo=BERLIN, fold=1)
    assert job.latest(second) == found[1]


def test_wildcard_hour_cron_keeps_real_time_steps_across_dst() -> None:
    # Jobs that run every so often (a * hour) run in both repeated hours,
    # as Debian cron does: every 30 real minutes, none lost, none doubled.
    job = make_schedule(cron="*/30 * * * *", timezone="Europe/Berlin")
    for start in (at(2024, 10, 26, 22), at(2024, 3, 30, 23)):
        found = slots(job, start, 8)
        gaps = {b - a for a, b in itertools.pairwise(found)}
        assert gaps == {timedelta(minutes=30)}, found
        for previous, slot in itertools.pairwise(found):
            assert job.latest(slot - timedelta(seconds=1)) == previous


def test_cron_new_york_spring_forward() -> None:
    # New York, 2024-03-10: 02:00 EST jumps to 03:00 EDT.
    job = make_schedule(cron="15 2 * * *", timezone="America/New_York")
    found = slots(job, at(2024, 3, 9, 12), 2)
    assert [s.astimezone(NEW_YORK).isoformat() for s in found] == [
        "2024-03-10T03:00:00-04:00",
        "2024-03-11T02:15:00-04:00",
    ]


def test_weekday_cron() -> None:
    job = make_schedule(cron="0 9 * * MON-FRI", timezone="Europe/Berlin")
    friday_evening = at(2024, 5, 3, 18, tz=BERLIN)
    assert job.following(friday_evening) == at(2024, 5, 6, 9, tz=BERLIN)
    assert job.latest(friday_evening) == at(2024, 5, 3, 9, tz=BERLIN)


@pytest.mark.parametrize(
    ("shortcut", "following", "latest"),
    [
        # From Wednesday 2024-05-15 10:30 in Berlin (CEST, UTC+2).
        ("@yearly", at(2025, 1, 1, tz=BERLIN), at(2024, 1, 1, tz=BERLIN)),
        ("@annually", at(2025, 1, 1, tz=BERLIN), at(2024, 1, 1, tz=BERLIN)),
        ("@monthly", at(2024, 6, 1, tz=BERLIN), at(2024, 5, 1, tz=BERLIN)),
        ("@weekly", at(2024, 5, 19, tz=BERLIN), at(2024, 5, 12, tz=BERLIN)),  # Sundays
        ("@daily", at(2024, 5, 16, tz=BERLIN), at(2024, 5, 15, tz=BERLIN)),
        ("@midnight", at(2024, 5, 16, tz=BERLIN), at(2024, 5, 15, tz=BERLIN)),
        ("@hourly", at(2024, 5, 15, 11, tz=BERLIN), at(2024, 5, 15, 10, tz=BERLIN)),
        ("  @DAILY ", at(2024, 5, 16, tz=BERLIN), at(2024, 5, 15, tz=BERLIN)),
    ],
)
def test_cron_shortcuts_are_the_expressions_cron_gives_them(
    shortcut: str, following: datetime, latest: datetime
) -> None:
    job = make_schedule(cron=shortcut, timezone="Europe/Berlin")
    now = at(2024, 5, 15, 10, 30, tz=BERLIN)
    assert job.following(now) == following
    assert job.latest(now) == latest
    assert slots(job, now, 2)[0] == following


def test_cron_shortcuts_in_words_and_on_the_wall_clock() -> None:
    daily = make_schedule(cron="@daily", timezone="Europe/Berlin")
    assert daily.describe() == make_schedule(cron="0 0 * * *", timezone="Europe/Berlin").describe()
    # Midnight in Berlin, across the spring change, stays midnight.
    assert slots(daily, at(2024, 3, 30, 12, tz=BERLIN), 2) == [
        at(2024, 3, 31, tz=BERLIN),
        at(2024, 4, 1, tz=BERLIN),
    ]


# -- declarations ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("declaration", "message"),
    [
        ({"every": 60, "cron": "* * * * *"}, "sets both `every` and `cron`"),
        ({}, "sets neither `every` nor `cron`"),
        ({"every": 0.5}, "`every` is 0.5 seconds; the shortest is 1"),
        ({"every": "60"}, "`every` must be a number of seconds"),
        ({"every": float("nan")}, "the shortest is 1"),
        ({"cron": "0 25 * * *"}, "cron '0 25 * * *': the hour field '25' is invalid"),
        ({"cron": "61 * * * *"}, "the minute field '61' is invalid"),
        ({"cron": "0 0 32 * *"}, "the day-of-month field '32' is invalid"),
        ({"cron": "0 0 * 13 *"}, "the month field '13' is invalid"),
        ({"cron": "0 0 * * 8"}, "the day-of-week field '8' is invalid"),
        ({"cron": "0 0 * *"}, "has 4 field(s); it needs 5"),
        ({"cron": "0 0 0 * * *"}, "has 6 field(s); it needs 5"),
        ({"cron": "@reboot"}, "'@reboot' has no slots"),
        ({"cron": "@fortnightly"}, "'@fortnightly' is not a cron shortcut (@yearly, @annually"),
        ({"cron": "0 3 * * *", "timezone": "Mars/Olympus"}, "'Mars/Olympus' is not a known"),
        ({"cron": "0 3 * * *", "timezone": ""}, "timezone must be an IANA name"),
    ],
)
def test_bad_declarations_say_what_is_wrong(declaration: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidSchedule) as caught:
        make_schedule(**declaration)  # type: ignore[arg-type]
    assert message in str(caught.value)


def test_slot_keys_round_trip_in_utc() -> None:
    slot = at(2024, 3, 31, 3, tz=BERLIN)
    assert slot_key(slot) == "2024-03-31T01:00:00+00:00"
    assert parse_slot(slot_key(slot)) == slot
