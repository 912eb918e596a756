"""Pausing queues and rate limits, on the real database of the leg.

Pause: the claim statements themselves skip paused queues, so a pause
holds from its commit for every claimer; unknown names are refused (API
and command). Rate limits: concurrent claimers, each a thread with its own
connection, never take more than N starts in any window of one period;
a handler at its limit holds back no other handler's rows.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction

from django_dbworker import UnknownQueue, pause_queue, resume_queue
from django_dbworker.checks import rate_limit_errors
from django_dbworker.flow.models import QueueState
from django_dbworker.flow.queues import known_queues, paused_queues, queue_list
from django_dbworker.handlers import WorkItemHandler
from django_dbworker.models import Status, WorkItem
from django_dbworker.registry import registry
from django_dbworker.testing import run_until_empty
from django_dbworker.validation import InvalidValue, rate_limit
from django_dbworker.worker import Worker
from tests.conftest import ROOT
from tests.factories import claim, make_item, worker_config
from tests.testapp.models import Execution
from tests.testapp.workers import Rated

pytestmark = pytest.mark.django_db(transaction=True)


# -- pause / resume -------------------------------------------------------------------


def test_a_pause_hides_the_queue_from_every_claim_until_resumed() -> None:
    emails = [make_item(queue="emails") for _ in range(3)]
    other = make_item(queue="other")
    pause_queue("emails", by="ops")
    assert [i.pk for i in claim(queues=None)] == [other.pk]
    assert claim(queues=["emails"]) == []
    assert claim(queues=["emails", "other"]) == []
    state = QueueState.objects.get(name="emails")
    assert state.paused and state.paused_by == "ops" and state.paused_at is not None
    assert paused_queues() == ["emails"]

    resume_queue("emails")
    assert sorted(i.pk for i in claim(queues=["emails"])) == sorted(i.pk for i in emails)
    assert paused_queues() == []


def test_pausing_twice_keeps_the_first_pause() -> None:
    make_item(queue="emails")
    first = pause_queue("emails", by="alice")
    again = pause_queue("emails", by="bob")
    assert again.paused_by == "alice" and again.paused_at == first.paused_at
    resumed = resume_queue("emails")
    assert not resumed.paused and resumed.paused_at is None
    assert not resume_queue("emails").paused  # resuming a running queue is fine


def test_known_queues_are_the_tables_the_handlers_and_default() -> None:
    make_item(queue="from-a-row")
    known = known_queues()
    assert {"from-a-row", "default", "echoes", "rated", "pausable"} <= known
    # A handler's default queue is known without any row.
    assert pause_queue("echoes").paused
    assert "echoes" in {q.name for q in queue_list() if q.paused}


def test_an_unknown_queue_is_refused_and_nothing_is_stored() -> None:
    with pytest.raises(UnknownQueue, match="'nope'"):
        pause_queue("nope")
    with pytest.raises(UnknownQueue, match="'nope'"):
        resume_queue("nope")
    with pytest.raises(ValueError, match="not a valid queue name"):
        pause_queue("bad name")
    assert not QueueState.objects.exists()


def test_a_queue_nothing_names_yet_can_be_paused_ahead_of_its_deploy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The operator pauses the queue the next deploy adds before its first item: a worker
    of the new code then claims none of its rows until it is resumed. Said on purpose
    (``new``, ``--new``), since an unknown name is otherwise a typo; the refusal says how."""
    with pytest.raises(CommandError, match="pause --new"):
        call_command("dbworker_queue", "pause", "reports-v2")
    call_command("dbworker_queue", "pause", "reports-v2", "--new", "--by", "ops")
    assert "Queue 'reports-v2' is paused (by ops)." in capsys.readouterr().out
    item = make_item(queue="reports-v2")
    assert claim(limit=10, queues=["reports-v2"]) == []
    assert pause_queue("later", new=True).paused
    resume_queue("reports-v2")
    assert [i.pk for i in claim(limit=10, queues=["reports-v2"])] == [item.pk]


def test_queue_list_counts_pending_and_claimed() -> None:
    for _ in range(3):
        make_item(queue="emails")
    make_item(queue="emails", status=Status.SUCCEEDED)
    claim(limit=1, queues=["emails"])
    pause_queue("emails", by="ops")
    (emails,) = [q for q in queue_list() if q.name == "emails"]
    assert (emails.pending, emails.claimed, emails.paused, emails.paused_by) == (2, 1, True, "ops")


def test_the_command_pauses_lists_and_resumes(capsys: pytest.CaptureFixture[str]) -> None:
    make_item(queue="emails")
    call_command("dbworker_queue", "pause", "emails", "--by", "ops")
    assert "Queue 'emails' is paused (by ops)." in capsys.readouterr().out
    call_command("dbworker_queue", "list")
    out = capsys.readouterr().out
    lines = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert lines["emails"][:4] == ["emails", "paused", "1", "0"]
    assert lines["emails"][-1] == "ops"
    assert lines["default"][:2] == ["default", "running"]
    call_command("dbworker_queue", "resume", "emails")
    assert "Queue 'emails' is running." in capsys.readouterr().out


def test_the_command_refuses_an_unknown_queue_with_one_line() -> None:
    with pytest.raises(CommandError, match="Unknown queue 'nope'"):
        call_command("dbworker_queue", "pause", "nope")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DBWORKER_TEST_DB_NAME": str(connection.settings_dict["NAME"]),
        "PYTHONPATH": str(ROOT),
    }
    for action in ("pause", "resume"):
        proc = subprocess.run(
            [sys.executable, "-m", "django", "dbworker_queue", action, "nope"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 1, proc
        assert "Traceback" not in proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith("CommandError: Unknown queue 'nope'"), line


def test_run_until_empty_leaves_a_paused_queue_alone() -> None:
    from tests.testapp.workers import Paused

    Paused.enqueue({"key": "a"})
    pause_queue("pausable")
    assert run_until_empty(["pausable"]).get("succeeded", 0) == 0
    assert WorkItem.objects.get().status == Status.PENDING
    resume_queue("pausable")
    assert run_until_empty(["pausable"])["succeeded"] == 1


# -- rate limits ------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0/s", "fast", "5/d", "-1/s", "1.5/s", " 5/s", 5])
def test_bad_rate_limits_are_check_errors(value: object) -> None:
    cls = type(
        "BadRate", (WorkItemHandler,), {"name": "bad_rate", "rate_limit": value, "abstract": True}
    )
    (error,) = rate_limit_errors([cls])
    assert error.id == "django_dbworker.E020"
    assert "'bad_rate'" in error.msg and repr(value) in error.msg
    with pytest.raises(InvalidValue):
        rate_limit(value)


def test_good_rate_limits_parse_and_pass_the_checks() -> None:
    assert rate_limit("50/s") == (50, 1.0)
    assert rate_limit("100/m") == (100, 60.0)
    assert rate_limit("1000/h") == (1000, 3600.0)
    assert rate_limit_errors(registry.values()) == []


def most_in_a_window(times: list[float], period: float) -> int:
    """The most times (seconds) in any half-open window of ``period`` seconds."""
    times = sorted(times)
    most = start = 0
    for end, t in enumerate(times):
        while t - times[start] >= period:
            start += 1
        most = max(most, end - start + 1)
    return most


def test_a_rate_limited_worker_waits_for_its_window_then_runs_the_rest(
    background_worker,
) -> None:
    from tests.testapp.workers import Rated

    Rated.enqueue_many([{"key": str(i)} for i in range(30)])
    started = time.monotonic()
    background_worker(["rated"], concurrency=4)
    from tests.conftest import wait_until

    wait_until(
        lambda: (
            Execution.objects.filter(kind="rated").count() == 30
            and not WorkItem.objects.filter(handler="rated", result__isnull=True).exists()
        ),
        timeout=20,
        what="all 30 rated items to run and record their starts",
    )
    # 20 per second: the last 10 waited for the first second's window.
    assert time.monotonic() - started >= 1.0
    # The starts, by the handlers' own records. The window's count of takes is never
    # exceeded; a handler starts just after its take, later on a loaded host (the
    # guide: starts can bunch by that delay), so each of the 4 threads can bring at
    # most one start taken before a second into it: at most 20 + 4, where all 30
    # would start at once without the limit.
    starts = [
        float(t) for t in WorkItem.objects.filter(handler="rated").values_list("result", flat=True)
    ]
    assert len(starts) == 30
    assert most_in_a_window(starts, 1.0) <= 20 + 4
    assert set(WorkItem.objects.values_list("attempts", flat=True)) == {1}


def test_a_pause_gives_back_rows_a_worker_buffered_and_lets_the_running_one_finish(
    background_worker, gate: None
) -> None:
    from tests.conftest import wait_until
    from tests.testapp.workers import GATE, Gate

    Gate.enqueue_many([{"key": f"fast-{n}"} for n in range(5)], priority=10, queue="held")
    Gate.enqueue_many([{"key": f"gated-{n}", "wait": True} for n in range(30)], queue="held")
    worker = background_worker(["gate"], concurrency=1, prefetch_horizon=5.0, poll_interval=0.2)
    wait_until(
        lambda: Execution.objects.filter(key__startswith="gated", kind="start").exists(),
        what="a gated item to start",
    )
    claimed = WorkItem.objects.filter(status=Status.CLAIMED)
    wait_until(lambda: claimed.count() >= 10, what="rows prefetched behind the running item")
    pause_queue("held")
    wait_until(
        lambda: claimed.count() == 1, timeout=5, what="the buffered rows of the paused queue"
    )
    wait_until(lambda: worker.given_back >= 9, what="the worker to count the give-back")
    GATE.set()
    wait_until(lambda: not claimed.exists(), what="the running item to finish")
    assert Execution.objects.filter(key__startswith="gated").count() == 1
    assert not WorkItem.objects.filter(status=Status.PENDING).exclude(attempts=0).exists()
    resume_queue("held")
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == 35,
        what="the rest to run after the resume",
    )


def test_the_paused_gauge_and_the_stats_show_paused_queues() -> None:
    from io import StringIO

    from prometheus_client import CollectorRegistry

    from django_dbworker.contrib.prometheus.collector import register, unregister

    make_item(queue="mail")
    make_item(queue="other")
    pause_queue("mail", by="ops")
    reg = CollectorRegistry()
    register(reg)
    try:
        assert reg.get_sample_value("dbworker_queue_paused", {"queue": "mail"}) == 1.0
        assert reg.get_sample_value("dbworker_queue_paused", {"queue": "other"}) == 0.0
    finally:
        unregister(reg)
    out = StringIO()
    call_command("dbworker_stats", stdout=out)
    text = out.getvalue()
    assert "Paused queues" in text
    (line,) = [line for line in text.splitlines() if line.startswith("mail ")][-1:]
    assert line.split()[:2] == ["mail", "1"] and line.split()[-1] == "ops"


def test_a_resume_wakes_an_idle_worker_at_once(background_worker) -> None:
    # A poll interval far longer than the wait: only the resume's wake-up
    # (NOTIFY on PostgreSQL, this process's waker elsewhere) can start it.
    from tests.conftest import wait_until
    from tests.testapp.workers import Paused

    worker = background_worker(["pausable"], poll_interval=60.0)
    wait_until(lambda: worker.idle.is_set(), what="the worker to go idle")
    pause_queue("pausable")
    Paused.enqueue({"key": "woken"})
    resume_queue("pausable")
    wait_until(
        lambda: Execution.objects.filter(kind="pausable").exists(),
        timeout=10,
        what="the resumed queue's item to run without waiting for a poll",
    )


# -- queue names and handler names compare byte for byte; burst workers skip paused queues ---
#
# Queue names are case-sensitive everywhere else: enqueue accepts "reports" and
# "Reports" as two queues, and the claim statements compare them byte for byte on
# every vendor (MySQL: the binary collation the initial migration gives).


def test_pausing_a_queue_that_differs_from_a_paused_one_only_in_case_pauses_it() -> None:
    make_item(queue="reports")
    upper = make_item(queue="Reports")
    pause_queue("reports", by="ops")
    state = pause_queue("Reports", by="ops")
    assert state.name == "Reports" and state.paused, (
        f"pause_queue('Reports') answered the state of queue {state.name!r}"
    )
    assert paused_queues() == ["Reports", "reports"]
    claimed = claim(queues=None)
    assert claimed == [], (
        f"both queues are paused, yet row {upper.pk} of 'Reports' was claimed: "
        f"{[(i.pk, i.queue) for i in claimed]}"
    )


def test_resuming_a_lookalike_queue_leaves_the_paused_one_paused() -> None:
    lower = make_item(queue="reports")
    make_item(queue="Reports")
    pause_queue("Reports", by="ops")
    resume_queue("reports")  # a known queue (it has a row), running already: no change
    assert paused_queues() == ["Reports"], "resuming 'reports' resumed 'Reports'"
    assert [i.pk for i in claim(queues=None)] == [lower.pk]


def test_a_lookalike_of_a_paused_queue_that_nothing_knows_is_refused() -> None:
    make_item(queue="reports")
    pause_queue("reports", by="ops")
    # "REPORTS": no row, no handler and no pause names it; it is an unknown queue.
    with pytest.raises(UnknownQueue, match="'REPORTS'"):
        pause_queue("REPORTS")
    with pytest.raises(CommandError, match="Unknown queue 'REPORTS'"):
        call_command("dbworker_queue", "resume", "REPORTS")
    assert paused_queues() == ["reports"], "resuming 'REPORTS' resumed 'reports'"


def _burst_exits(names: list[str], timeout: float = 15.0) -> bool:
    """Run a burst worker (not inline) in a thread; whether it returned within ``timeout``."""
    worker = Worker([registry[n] for n in names], worker_config(burst=True, poll_interval=0.1))
    thread = threading.Thread(target=worker.run, daemon=True, name="burst")
    thread.start()
    thread.join(timeout)
    exited = not thread.is_alive()
    if not exited:
        worker.stop(immediate=True)
        thread.join(15)
        assert not thread.is_alive(), "the burst worker did not stop"
    return exited


def test_a_burst_worker_leaves_a_paused_queue_alone_with_or_without_keys() -> None:
    """--burst ends when nothing is claimable; a paused queue's rows are claimable by no
    worker. Unkeyed, the burst worker exits; keyed, it must not wait for them for ever."""
    from tests.testapp.workers import Keyed, Paused

    Paused.enqueue({"key": "plain"})
    pause_queue("pausable")
    assert _burst_exits(["pausable"]), "burst did not exit with a paused unkeyed row"

    Keyed.enqueue({"key": "k"}, concurrency_key="k", queue="pausable")
    assert _burst_exits(["keyed"]), (
        "a burst worker for a handler with a concurrency_limit never exits while a keyed "
        "row waits in a paused queue (keys_busy counts it as waiting for a key's slot)"
    )
    assert WorkItem.objects.filter(status=Status.PENDING, attempts=0).count() == 2


# -- rate-limited rows enqueued in the caller's own transaction ------------------------


def test_rows_of_the_callers_transaction_are_seen_by_the_read() -> None:
    with transaction.atomic():
        Rated.enqueue({"n": 1})
        Rated.enqueue({"n": 2})
        assert run_until_empty(["rated"]).get("succeeded") == 2
