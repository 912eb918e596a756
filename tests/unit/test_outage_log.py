"""What a worker says about an unreachable database: lost once, reminders, back once."""

from __future__ import annotations

import logging

import pytest
from django.db import OperationalError

from django_dbworker.worker import connections
from django_dbworker.worker.connections import DatabaseOutage


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


REFUSED = OperationalError(
    'connection to server at "127.0.0.1", port 5432 failed: Connection refused\n'
    "\tIs the server running on that host and accepting TCP/IP connections?"
)


def _said(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.INFO]


def test_an_outage_is_one_warning_reminders_and_one_info_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    outage = DatabaseOutage(clock)
    caplog.set_level(logging.DEBUG, logger="django_dbworker")
    for what in ("claiming", "heartbeat", "scheduling periodic work", "claiming"):
        outage.lost("default", what, REFUSED)
        clock.now += 0.5
    clock.now += connections.OUTAGE_REMINDER_EVERY  # 32 s down
    for _ in range(5):
        outage.lost("default", "claiming", REFUSED)
        clock.now += 1
    outage.back("default", reached=True)
    outage.back("default", reached=True)
    assert _said(caplog) == [
        (
            "WARNING",
            "Database 'default' is unreachable (heartbeat: connection to server at "
            '"127.0.0.1", port 5432 failed: Connection refused); retrying until it is back.',
        ),
        (
            "WARNING",
            "Database 'default' is still unreachable after 32s (connection to server at "
            '"127.0.0.1", port 5432 failed: Connection refused); retrying.',
        ),
        ("INFO", "Database 'default' is reachable again after 37s."),
    ]
    assert not outage.is_down("default")


def test_one_error_that_heals_on_its_retry_is_not_an_outage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A connection the server closed while it sat idle: the retry reconnects.
    outage = DatabaseOutage(FakeClock())
    caplog.set_level(logging.DEBUG, logger="django_dbworker")
    outage.lost("default", "recording successes", OperationalError("terminating connection"))
    outage.back("default", reached=True)
    assert _said(caplog) == []


def test_a_step_that_opened_no_connection_does_not_end_the_outage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A heartbeat with nothing running succeeds without the database.
    outage = DatabaseOutage(FakeClock())
    outage.lost("default", "claiming", REFUSED)
    outage.lost("default", "claiming", REFUSED)
    outage.back("default")  # this thread holds no connection
    assert outage.is_down("default")
