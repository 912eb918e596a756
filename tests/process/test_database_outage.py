"""A database outage as ``run_workers`` logs it: lost once, reminded, back once.

The throwaway PostgreSQL server is stopped (its data kept: ``pgcluster.py
down``) while a worker with claims, heartbeats, the wake-up listener and a
periodic handler runs, then started again (``up``). Reminders come every
``OUTAGE_REMINDER_EVERY`` seconds, lowered here so the outage stays short.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import DatabaseError, connection

from django_dbworker.models import Status, WorkItem
from tests.conftest import ROOT, wait_until
from tests.testapp.workers import Sleep

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]

#: Seconds between reminders in the worker under test (30 in production).
REMINDER = 3.0

RUN = """
import sys
import logging
import django
django.setup()
# The level first on every line (tests/settings.py logs the message only).
for handler in logging.getLogger("django_dbworker").handlers:
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
from django_dbworker.worker import connections
connections.OUTAGE_REMINDER_EVERY = float(sys.argv[1])
from django.core.management import call_command
call_command("run_workers", *sys.argv[2:])
"""


def _cluster(action: str) -> None:
    state = os.environ.get("DBWORKER_PG_STATE")
    if not state:
        pytest.skip(
            "DBWORKER_PG_STATE is not set: this run did not start its own PostgreSQL "
            "(scripts/test sets it), so the server cannot be stopped"
        )
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "pgcluster.py"), action, "--state", state],
        check=True,
        timeout=120,
    )


def _succeeded() -> int:
    try:
        return WorkItem.objects.filter(status=Status.SUCCEEDED).count()
    except DatabaseError:
        connection.close()
        return -1


def test_an_outage_is_one_warning_reminders_and_one_line_when_back(
    worker_env: dict[str, str], tmp_path: Path
) -> None:
    if not os.environ.get("DBWORKER_PG_STATE"):
        _cluster("down")  # skips, saying why
    Sleep.enqueue_many([{"key": str(i), "seconds": 0.01} for i in range(5)])
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", RUN, str(REMINDER), "sleep", "tick", "--concurrency", "2"],
            cwd=ROOT,
            env=worker_env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(lambda: _succeeded() >= 7, timeout=30, what="work and ticks before the outage")
        connection.close()
        before = len(log_path.read_text().splitlines())
        _cluster("down")
        try:
            wait_until(
                lambda: "unreachable" in log_path.read_text(),
                timeout=20,
                what="the worker to notice the outage",
            )
            # Down until the worker has reminded us at least once.
            wait_until(
                lambda: "still unreachable" in log_path.read_text(),
                timeout=REMINDER * 4,
                what="a reminder that the database is still unreachable",
            )
        finally:
            _cluster("up")
        wait_until(
            lambda: "reachable again" in log_path.read_text(),
            timeout=60,
            what="the worker to say the database is back",
        )
        Sleep.enqueue({"key": "after", "seconds": 0.01})
        wait_until(
            lambda: WorkItem.objects.filter(status=Status.SUCCEEDED, payload__key="after").exists(),
            timeout=30,
            what="work enqueued after the outage to run",
        )
        # The scheduler's first pass after the outage names the slots it missed
        # (on its own clock: it can come after the claim loop's first work).
        wait_until(
            lambda: "missed slots while the database was unreachable" in log_path.read_text(),
            timeout=30,
            what="the scheduler to name the slots missed during the outage",
        )
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    lines = log_path.read_text().splitlines()[before:]
    during = lines[: next(i for i, line in enumerate(lines) if "reachable again" in line) + 1]
    # One line per message: no driver text continued on tab-indented lines.
    assert not [line for line in during if line.startswith(("\t", " "))], "\n".join(during)
    lost = [line for line in during if "Database 'default' is unreachable" in line]
    reminders = [line for line in during if "Database 'default' is still unreachable" in line]
    back = [line for line in during if "Database 'default' is reachable again" in line]
    assert len(lost) == 1, "\n".join(during)
    assert lost[0].startswith("WARNING ")
    assert 1 <= len(reminders) <= 3, "\n".join(during)
    assert all(re.search(r"still unreachable after \d+ ?s", line) for line in reminders)
    assert len(back) == 1 and back[0].startswith("INFO "), "\n".join(during)
    # Nothing else at WARNING or above while the database was away.
    others = [
        line
        for line in during
        if line.startswith(("WARNING", "ERROR", "CRITICAL")) and line not in lost + reminders
    ]
    assert others == [], "\n".join(during)
    # The periodic slots missed meanwhile are not blamed on "no worker".
    after = "\n".join(lines)
    assert "no worker ran" not in after
    assert "missed slots while the database was unreachable" in after
