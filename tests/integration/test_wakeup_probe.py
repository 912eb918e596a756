"""The listener's start-up probe on a direct PostgreSQL connection.

A probe that arrives means no warning; one that cannot arrive (the LISTEN
connection reaches another database than the one enqueuers notify on: a
WAKEUP_DATABASE pointing elsewhere) is the WARNING that names
WAKEUP_DATABASE and POLL_INTERVAL. Through PgBouncer the same warning comes
for the pooler (tests/process/test_pgbouncer.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from django_dbworker.worker.wakeup import Listener

pytestmark = [
    pytest.mark.postgres_only,
    pytest.mark.django_db(transaction=True, databases=["default", "work"]),
]


def listener(using: str, *, probe_timeout: float = 2.0) -> Listener:
    return Listener(
        using=using,
        queues=None,
        wake=lambda priority: None,
        probe_using="default",
        probe_timeout=probe_timeout,
        poll_interval=30.0,
        wakeup_database=None if using == "default" else using,
    )


@pytest.fixture
def started() -> Iterator[list[Listener]]:
    listeners: list[Listener] = []
    yield listeners
    for each in listeners:
        each.stop()
        each.join(10)


def test_a_direct_connection_hears_its_probe_and_warns_of_nothing(
    started: list[Listener], caplog: pytest.LogCaptureFixture
) -> None:
    each = listener("default")
    started.append(each)
    with caplog.at_level(logging.DEBUG, logger="django_dbworker"):
        each.start()
        assert each.checked.wait(20), "the probe was neither heard nor given up on"
    assert each.reached
    assert "Wake-ups reach the listener on database 'default'" in caplog.text
    assert "Wake-ups cannot reach" not in caplog.text


def test_a_wakeup_database_of_another_database_is_a_warning(
    started: list[Listener], caplog: pytest.LogCaptureFixture
) -> None:
    # "work" is another database of the same server: enqueuers notify on
    # "default", so nothing ever arrives there.
    each = listener("work")
    started.append(each)
    with caplog.at_level(logging.WARNING, logger="django_dbworker"):
        each.start()
        assert each.checked.wait(20), "the probe was neither heard nor given up on"
    assert not each.reached
    (record,) = [r for r in caplog.records if "Wake-ups cannot reach" in r.getMessage()]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "sent on database 'default'" in message
    assert "WAKEUP_DATABASE 'work'" in message
    assert "POLL_INTERVAL (30s)" in message


def test_a_wakeup_database_that_is_no_alias_is_one_warning_not_a_dead_thread(
    started: list[Listener], caplog: pytest.LogCaptureFixture
) -> None:
    each = listener("nope")
    started.append(each)
    with caplog.at_level(logging.WARNING, logger="django_dbworker"):
        each.start()
        each.join(20)
    assert each.checked.is_set() and not each.reached
    (record,) = [r for r in caplog.records if "Wake-ups cannot reach" in r.getMessage()]
    assert "WAKEUP_DATABASE 'nope' is not a PostgreSQL alias of DATABASES" in record.getMessage()
    assert "polls every POLL_INTERVAL (30s)" in record.getMessage()
