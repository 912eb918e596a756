"""Operators see the live ``run_workers`` processes: the admin's Workers page and the
Workers section of ``dbworker_stats``, with real subprocess workers and real signals.

A worker shows from its start with what it runs and holds; a clean stop (SIGTERM)
removes its row at once; a killed one (SIGKILL) leaves the page within STALE_AFTER
and its row is deleted by another worker's stale-recovery pass.
"""

from __future__ import annotations

import io
import signal
import socket
import time
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.test import Client, override_settings
from django.urls import reverse

from django_dbworker.fleet.models import LiveWorker
from django_dbworker.models import Status, WorkItem
from tests.conftest import wait_until
from tests.testapp.models import Execution
from tests.testapp.workers import Sleep

pytestmark = pytest.mark.django_db(transaction=True)

#: The small STALE_AFTER of the process tests (run_workers' and this process's).
STALE_AFTER = 1.0
FAST_STALE = {"DBWORKER_STALE_AFTER": str(STALE_AFTER)}
WORKERS = "admin:django_dbworker_liveworker_changelist"
CLAIMED = "admin:django_dbworker_claimedworkitem_changelist"


def stats() -> str:
    out = io.StringIO()
    call_command("dbworker_stats", stdout=out)
    return out.getvalue()


def stats_row(pid: int) -> list[str] | None:
    """The Workers section's row of the process ``pid``, split into its cells."""
    text = stats()
    section = text.split("Workers: ", 1)[1].split("\n\n", 1)[0]
    for line in section.splitlines()[2:]:
        cells = line.split()
        if len(cells) > 1 and cells[1] == str(pid):
            return cells
    return None


def page_row(client: Client, name: str) -> str | None:
    """The Workers page's table row of the worker ``name`` (its HTML), or None."""
    html = client.get(reverse(WORKERS)).content.decode()
    marker = f'data-name="{name}"'
    if marker not in html:
        return None
    return html.split(marker, 1)[1].split("</tr>", 1)[0]


def test_a_worker_shows_what_it_runs_and_holds_and_a_clean_stop_removes_it(
    start_worker: Any, admin_client: Client
) -> None:
    host = socket.gethostname()
    # Two processes on one host: a WorkItem worker of two queues, and one of an
    # own-table handler only (its heartbeat thread runs for the register alone).
    worker = start_worker("sleep", "--queue", "a", "--queue", "b", "--concurrency", "3")
    mailer = start_worker("invoice-mailer")
    name, mailer_name = f"{host}:{worker.pid}", f"{host}:{mailer.pid}"
    wait_until(
        lambda: stats_row(worker.pid) and stats_row(mailer.pid),
        timeout=30,
        what="both workers in dbworker_stats",
    )
    item = Sleep.enqueue({"key": "slow", "seconds": 30}, queue="b")
    wait_until(lambda: Execution.objects.filter(key="slow", kind="start").exists())
    row = wait_until(
        lambda: (r := stats_row(worker.pid)) and r[5] == "1" and r,
        what="the running item counted",
    )
    assert row[:6] == [host, str(worker.pid), "a,b", "sleep", "3", "1"]
    # "0.3s ago", then the start's date and time (UTC), then the version.
    assert row[6].endswith("s") and row[7] == "ago" and row[-1] == "0.1.0"
    assert stats_row(mailer.pid)[2:6] == ["all", "invoice-mailer", "4", "0"]  # type: ignore[index]

    html = page_row(admin_client, name)
    assert html is not None and host in html and "a, b" in html and "sleep" in html
    link = f"{reverse(CLAIMED)}?worker={name}"
    assert f'href="{link}">1</a>' in html.replace("%3A", ":")
    assert page_row(admin_client, mailer_name) is not None
    # The link lists that worker's claimed items (and no other worker's).
    claimed = admin_client.get(link)
    assert claimed.status_code == 200
    assert f"/claimedworkitem/{item.pk}/change/" in claimed.content.decode()
    other = admin_client.get(f"{reverse(CLAIMED)}?worker={mailer_name}").content.decode()
    assert f"/claimedworkitem/{item.pk}/change/" not in other

    for proc in (worker, mailer):
        proc.signal(signal.SIGTERM)
    mailer.wait()
    assert not LiveWorker.objects.filter(name=mailer_name).exists()
    assert stats_row(mailer.pid) is None
    # The sleeping item holds its worker until the shutdown timeout, which
    # releases it: the row stays while the process drains, and goes at its exit.
    worker.wait_for_log("SIGTERM received")
    assert LiveWorker.objects.filter(name=name).exists()
    worker.signal(signal.SIGTERM)  # the second signal: stop at once
    assert worker.wait() == 0, worker.log()
    assert not LiveWorker.objects.filter(name=name).exists()
    assert page_row(admin_client, name) is None
    assert WorkItem.objects.get(pk=item.pk).status == Status.PENDING  # released


def test_a_killed_worker_leaves_the_page_within_stale_after_and_its_row_is_deleted(
    start_worker: Any, admin_client: Client
) -> None:
    host = socket.gethostname()
    victim = start_worker("sleep", env=FAST_STALE)
    name = f"{host}:{victim.pid}"
    fast = {**settings.DBWORKER, "STALE_AFTER": STALE_AFTER}
    with override_settings(DBWORKER=fast):
        wait_until(lambda: page_row(admin_client, name), timeout=30, what="the worker's row")
        victim.signal(signal.SIGKILL)
        assert victim.wait() == -signal.SIGKILL
        killed = time.monotonic()
        assert LiveWorker.objects.filter(name=name).exists()  # nobody deleted it
        # Gone from the page and the stats within STALE_AFTER of its last heartbeat
        # (one heartbeat interval before the kill, at most), before its row is deleted.
        wait_until(lambda: page_row(admin_client, name) is None, timeout=10, what="it leaves")
        assert time.monotonic() - killed <= STALE_AFTER + 1.0
        assert stats_row(victim.pid) is None
        assert LiveWorker.objects.filter(name=name).exists()
        # Another worker's stale-recovery pass deletes the row.
        other = start_worker("sleep", env=FAST_STALE)
        wait_until(
            lambda: not LiveWorker.objects.filter(name=name).exists(),
            timeout=20,
            what="the other worker's recovery pass to delete the dead row",
        )
        assert page_row(admin_client, f"{host}:{other.pid}") is not None
        other.signal(signal.SIGTERM)
        assert other.wait() == 0


def test_a_burst_worker_shows_while_it_runs_and_removes_its_row_at_its_end(
    start_worker: Any,
) -> None:
    Sleep.enqueue({"key": "b", "seconds": 1.5})
    worker = start_worker("sleep", "--burst")
    name = f"{socket.gethostname()}:{worker.pid}"
    wait_until(lambda: LiveWorker.objects.filter(name=name).exists(), what="its row")
    assert worker.wait() == 0, worker.log()
    assert not LiveWorker.objects.exists()
