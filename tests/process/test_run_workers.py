"""``manage.py run_workers`` as a real subprocess: signals, crashes, many processes."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import DatabaseError, connection
from django.db.models import Count
from django.db.models.functions import Now

from django_dbworker.models import Status, WorkItem
from tests.conftest import ROOT, kill_other_connections, restart_server, wait_until
from tests.factories import claim
from tests.testapp.models import Execution, Invoice
from tests.testapp.workers import KillWorker, Record, Sleep

pytestmark = pytest.mark.django_db(transaction=True)

FAST_STALE = {"DBWORKER_STALE_AFTER": "1.0"}


def status_of(pk: int) -> str:
    return WorkItem.objects.get(pk=pk).status


def assert_each_key_ran_once(n: int) -> None:
    counts = Execution.objects.filter(kind="run").values("key").annotate(n=Count("id"))
    assert len(counts) == n
    assert {c["n"] for c in counts} == {1}


@pytest.mark.pgbouncer
def test_burst_runs_everything_and_exits_zero(start_worker) -> None:
    Record.enqueue_many([{"key": str(i)} for i in range(20)])
    worker = start_worker("record", "--burst", "--concurrency", "2")
    assert worker.wait() == 0
    log = worker.log()
    assert "Starting worker: handlers=record queues=all concurrency=2 database=" in log
    assert WorkItem.objects.filter(status=Status.SUCCEEDED).count() == 20
    assert_each_key_ran_once(20)
    # No per-success noise: "succeeded" appears once, in the closing summary.
    assert log.lower().count("succeeded") == 1
    assert "Worker stopped: 20 succeeded, 0 failed, 0 retried, 0 released" in log


def test_unknown_handler_exits_2_and_lists_registered_names(start_worker) -> None:
    worker = start_worker("nope")
    assert worker.wait() == 2
    assert "Unknown handler name(s): nope. Registered handlers:" in worker.log()
    assert "record" in worker.log()


def test_unmigrated_database_is_a_clear_startup_error(start_worker, tmp_path: Path) -> None:
    env = {
        "DATABASE_URL": "",
        "DBWORKER_TEST_DB_NAME": "",
        "DBWORKER_TEST_SQLITE": str(tmp_path / "empty.sqlite3"),
    }
    worker = start_worker("record", "--burst", env=env)
    assert worker.wait() == 1
    assert "migrations are not applied" in worker.log()
    assert "manage.py migrate" in worker.log()


@pytest.mark.pgbouncer
def test_three_processes_run_each_item_exactly_once(start_worker) -> None:
    # Enough work that it outlasts one process's prefetch buffer (what its
    # threads start within PREFETCH_HORIZON), so the claims spread.
    # All three are up and idle before the work arrives, so that a fast
    # machine cannot let the first process finish before the others start.
    n = 2000
    workers = [start_worker("record", "--concurrency", "4") for _ in range(3)]
    for worker in workers:
        worker.wait_for_log("Starting worker", timeout=60)
    Record.enqueue_many([{"key": str(i)} for i in range(n)])
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == n,
        timeout=180,
        what="every item to succeed",
    )
    for worker in workers:
        worker.signal(signal.SIGTERM)
    for worker in workers:
        assert worker.wait(timeout=60) == 0, worker.log()
    assert_each_key_ran_once(n)
    # More than one process did real work (the claim spreads across them).
    assert Execution.objects.values("pid").distinct().count() >= 2


@pytest.mark.pgbouncer
def test_sigkill_mid_job_is_recovered_and_the_lost_run_counts(start_worker) -> None:
    item = Sleep.enqueue({"key": "k", "seconds": 1.0})
    first = start_worker("sleep")
    wait_until(lambda: Execution.objects.filter(key="k", kind="start").exists())
    first.signal(signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    assert status_of(item.pk) == Status.CLAIMED  # nobody finished it
    second = start_worker("sleep", env=FAST_STALE)
    wait_until(
        lambda: status_of(item.pk) == Status.SUCCEEDED,
        timeout=30,
        what="the recovered item to succeed",
    )
    row = WorkItem.objects.get(pk=item.pk)
    assert row.attempts == 2
    assert Execution.objects.filter(key="k", kind="start").count() == 2
    assert Execution.objects.filter(key="k", kind="end").count() == 1
    second.signal(signal.SIGTERM)
    assert second.wait() == 0


@pytest.mark.pgbouncer
def test_a_job_that_kills_its_worker_every_time_ends_failed(start_worker) -> None:
    item = KillWorker.enqueue({"key": "doom"})
    for _ in range(6):
        worker = start_worker("kill_worker", env=FAST_STALE)
        wait_until(
            lambda w=worker: w.proc.poll() is not None or status_of(item.pk) == "failed",
            timeout=30,
            what="the worker to die or the item to fail",
        )
        if status_of(item.pk) == Status.FAILED:
            worker.signal(signal.SIGTERM)
            assert worker.wait() == 0
            break
        assert worker.proc.returncode == -signal.SIGKILL
    row = WorkItem.objects.get(pk=item.pk)
    assert (row.status, row.attempts) == (Status.FAILED, 3)
    assert "attempts used up" in row.last_error
    assert Execution.objects.filter(key="doom").count() == 3


@pytest.mark.pgbouncer
def test_sigterm_lets_running_items_finish(start_worker) -> None:
    item = Sleep.enqueue({"key": "t", "seconds": 1.0})
    worker = start_worker("sleep", "--shutdown-timeout", "20")
    wait_until(lambda: Execution.objects.filter(key="t", kind="start").exists())
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0
    assert status_of(item.pk) == Status.SUCCEEDED
    assert "SIGTERM received" in worker.log()


@pytest.mark.pgbouncer
def test_sigterm_past_the_shutdown_timeout_releases_rows(start_worker) -> None:
    item = Sleep.enqueue({"key": "r", "seconds": 30})
    worker = start_worker("sleep", "--shutdown-timeout", "0.5")
    wait_until(lambda: Execution.objects.filter(key="r", kind="start").exists())
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=15) == 0
    row = WorkItem.objects.get(pk=item.pk)
    assert (row.status, row.attempts, row.claim_token) == (Status.PENDING, 0, None)
    assert "Released 1 unfinished work item(s)" in worker.log()


def test_a_second_signal_releases_at_once(start_worker) -> None:
    item = Sleep.enqueue({"key": "i", "seconds": 60})
    worker = start_worker("sleep", "--shutdown-timeout", "120")
    wait_until(lambda: Execution.objects.filter(key="i", kind="start").exists())
    worker.signal(signal.SIGTERM)
    worker.wait_for_log("SIGTERM received")
    worker.signal(signal.SIGINT)
    assert worker.wait(timeout=15) == 0
    assert status_of(item.pk) == Status.PENDING


def test_own_table_handler_runs_in_its_own_loop(start_worker) -> None:
    Invoice.objects.bulk_create([Invoice() for _ in range(30)])
    worker = start_worker("invoice-mailer", "--burst")
    assert worker.wait() == 0
    assert Invoice.objects.filter(status="sent").count() == 30


def _terminate_other_backends() -> int:
    try:
        return kill_other_connections()
    except DatabaseError:  # given a pooled connection the last kill ended
        connection.close()
        return kill_other_connections()


def _succeeded_tolerating_disconnects() -> int:
    """Count succeeded items; -1 when the test's own connection was dropped.

    Through PgBouncer in transaction mode the test's next query may be given a
    pooled server connection that the kill just ended: that query fails and
    PgBouncer closes the client. A restarted server does the same. Reconnect
    on the next try.
    """
    try:
        return WorkItem.objects.filter(status=Status.SUCCEEDED).count()
    except DatabaseError:
        connection.close()
        return -1


@pytest.mark.server_db
@pytest.mark.pgbouncer
def test_worker_survives_killed_connections(start_worker) -> None:
    Sleep.enqueue_many([{"key": str(i), "seconds": 0.05} for i in range(150)])
    worker = start_worker("sleep", "--concurrency", "4", env=FAST_STALE)
    wait_until(lambda: _succeeded_tolerating_disconnects() >= 20)
    assert _terminate_other_backends() >= 1
    wait_until(lambda: _succeeded_tolerating_disconnects() >= 60, timeout=30)
    _terminate_other_backends()
    wait_until(
        lambda: _succeeded_tolerating_disconnects() == 150,
        timeout=60,
        what="every item to succeed after the connections were killed",
    )
    assert worker.proc.poll() is None, worker.log()
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0


@pytest.mark.server_db
def test_worker_survives_a_server_restart(start_worker) -> None:
    if not os.environ.get(
        "DBWORKER_MARIADB_STATE" if connection.vendor == "mysql" else "DBWORKER_PG_STATE"
    ):
        restart_server()  # skips, saying why
    Sleep.enqueue_many([{"key": str(i), "seconds": 0.05} for i in range(120)])
    worker = start_worker("sleep", "--concurrency", "4", env=FAST_STALE)
    wait_until(lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() >= 20)
    restart_server()
    wait_until(
        lambda: _succeeded_tolerating_disconnects() == 120,
        timeout=90,
        what="every item to succeed after the restart",
    )
    assert worker.proc.poll() is None, worker.log()
    assert "Database unavailable" in worker.log() or "retrying" in worker.log()
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0


def test_abandoned_threads_at_the_cap_stop_the_worker_non_zero(start_worker) -> None:
    from tests.testapp.workers import Slow

    Slow.enqueue_many([{"key": f"s{n}", "seconds": 4} for n in range(3)])
    worker = start_worker("slow", "--concurrency", "1", env={"DBWORKER_MAX_ABANDONED_THREADS": "1"})
    assert worker.wait(timeout=30) == 3
    log = worker.log()
    assert "abandoned threads" in log and "the cap is 1 (MAX_ABANDONED_THREADS)" in log
    assert "Worker stopped itself" in log
    # One item timed out (retry scheduled); the others were never claimed.
    assert WorkItem.objects.filter(status=Status.PENDING, attempts=0).count() == 2
    assert not WorkItem.objects.filter(status=Status.CLAIMED).exists()


@pytest.mark.sqlite_only
def test_a_long_atomic_handler_on_sqlite_does_not_make_other_workers_claims_stale(
    start_worker,
) -> None:
    from tests.testapp.workers import AtomicWrite, NonAtomicLinger

    # SQLite has one write lock: while an atomic handler's transaction holds
    # it (2.5 s, more than twice STALE_AFTER) no heartbeat can be written.
    lingering = NonAtomicLinger.enqueue_many([{"key": f"l{n}", "seconds": 5} for n in range(4)])
    workers = [start_worker("linger", "atomic_write", env=FAST_STALE) for _ in range(2)]
    wait_until(lambda: Execution.objects.filter(kind="start").count() == 4)
    atomic = AtomicWrite.enqueue({"key": "a", "seconds": 2.5})
    wait_until(
        lambda: not WorkItem.objects.filter(status__in=(Status.PENDING, Status.CLAIMED)).exists(),
        timeout=40,
        what="every item to finish",
    )
    for worker in workers:
        worker.signal(signal.SIGTERM)
        assert worker.wait() == 0
    logs = "".join(w.log() for w in workers)
    for item in [*lingering, atomic]:
        row = WorkItem.objects.get(pk=item.pk)
        assert (row.status, row.attempts) == (Status.SUCCEEDED, 1), (row.pk, row.last_error, logs)
    assert "Recovered" not in logs


def test_an_own_table_handler_without_claim_is_a_startup_error(start_worker) -> None:
    # Without the check the loop would see NoTask (or an error) forever: a
    # handler that never runs anything and never says why.
    worker = start_worker("claimless", "--burst", env={"DBWORKER_TEST_CLAIMLESS": "1"})
    assert worker.wait() == 2
    assert (
        "Handler 'claimless' (tests.testapp.workers.Claimless) does not implement claim()"
        in worker.log()
    )


def test_unreachable_database_is_one_clear_line_and_exit_1(start_worker) -> None:
    # A port nothing listens on: the connection is refused at once.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        "DATABASE_URL": f"postgres://nobody@127.0.0.1:{port}/nothing",
        "DBWORKER_TEST_DB_NAME": "",
    }
    worker = start_worker("record", "--burst", env=env)
    assert worker.wait() == 1
    log = worker.log()
    assert f"Cannot reach the database 'default' at 127.0.0.1:{port}" in log
    assert "Traceback" not in log
    assert len(log.strip().splitlines()) <= 3, log


def test_pending_rows_no_handler_runs_are_warned_about_at_start(start_worker) -> None:
    WorkItem.objects.create(handler="renamed_long_ago", max_attempts=1, payload={})
    Record.enqueue({"key": "r"})
    worker = start_worker("record", "--burst")
    assert worker.wait() == 0
    log = worker.log()
    assert "1 pending item(s) of handler 'renamed_long_ago'" in log
    assert "workers.py" in log


@pytest.mark.pgbouncer
def test_burst_ends_with_a_one_line_summary(start_worker) -> None:
    from tests.testapp.workers import AlwaysFail

    Record.enqueue_many([{"key": str(i)} for i in range(3)])
    AlwaysFail.enqueue({"key": "f"}, run_after=None)
    # The retry is due in a minute, so the burst ends before it: with the
    # suite's 0.05 s backoff a loaded machine could run it within the burst.
    slow_retry = {"DBWORKER_RETRY_BACKOFF": "60", "DBWORKER_RETRY_BACKOFF_MAX": "60"}
    worker = start_worker("record", "always_fail", "--burst", env=slow_retry)
    assert worker.wait() == 0
    assert "Worker stopped: 3 succeeded, 0 failed, 1 retried, 0 released" in worker.log(), (
        worker.log()
    )


def test_verbosity_2_logs_each_item(start_worker) -> None:
    items = Record.enqueue_many([{"key": str(i)} for i in range(2)])
    worker = start_worker("record", "--burst", "-v", "2")
    assert worker.wait() == 0
    for item in items:
        assert f"Work item {item.pk} (record) attempt 1: succeeded." in worker.log()
    quiet_item = Record.enqueue({"key": "q"})
    quiet = start_worker("record", "--burst")
    assert quiet.wait() == 0
    assert WorkItem.objects.get(pk=quiet_item.pk).status == Status.SUCCEEDED
    assert "attempt 1: succeeded." not in quiet.log()


# -- rows a dead worker left are recovered and run ---------------------------------------


def _left_by_a_dead_worker(count: int) -> list[int]:
    """``count`` record rows claimed by a worker that died, heartbeats an hour old."""
    Record.enqueue_many([{"key": f"stale-{i}"} for i in range(count)])
    claimed = claim(limit=count, handlers=["record"], worker="dead:1:main")
    assert len(claimed) == count
    WorkItem.objects.filter(pk__in=[i.pk for i in claimed]).update(
        heartbeat_at=Now() - timedelta(hours=1)
    )
    return [i.pk for i in claimed]


def test_a_burst_worker_recovers_and_runs_a_dead_workers_rows(start_worker) -> None:
    """Stale rows and nothing else: a burst run recovers them and runs them before exiting.

    The recovery pass runs after a claim that found nothing; burst mode must not exit
    on that empty claim, leaving the requeued rows pending with no worker to run them.
    """
    pks = _left_by_a_dead_worker(3)
    worker = start_worker("record", "--burst", env={"DBWORKER_STALE_AFTER": "1.0"})
    assert worker.wait() == 0
    statuses = dict(WorkItem.objects.filter(pk__in=pks).values_list("pk", "status"))
    assert set(statuses.values()) == {Status.SUCCEEDED}, (statuses, worker.log())
    assert Execution.objects.filter(kind="run").count() == 3


def test_stale_rows_are_recovered_while_claims_keep_failing(start_worker) -> None:
    """A claim statement that fails every time (here: a table it reads is gone) skips no pass.

    The pass is best effort and independent of the claim ("claiming must go
    on", and the other way round): a dead worker's rows go back to pending for
    the workers that can claim, also while this worker's claim raises.
    """
    pks = _left_by_a_dead_worker(2)
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE django_dbworker_queuestate RENAME TO dbworker_queuestate_moved")
    try:
        worker = start_worker("record", env={"DBWORKER_STALE_AFTER": "1.0"})
        worker.wait_for_log("retrying in", timeout=30)  # the claim failed
        wait_until(
            lambda: (
                set(WorkItem.objects.filter(pk__in=pks).values_list("status", flat=True))
                == {Status.PENDING}
            ),
            timeout=20,
            what="the dead worker's rows back to pending",
        )
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                "ALTER TABLE dbworker_queuestate_moved RENAME TO django_dbworker_queuestate"
            )


def test_a_killed_workers_buffered_rows_use_an_attempt_too(start_worker) -> None:
    """Decided (docs/topics/retries.md): an attempt is counted when a row is claimed, and
    stale recovery cannot tell a row that started from one that waited in the killed
    worker's buffer; with ``max_attempts = 1`` such a row ends ``failed`` without having
    run. (max_attempts >= 2, or PREFETCH_HORIZON = 0, keeps it.)"""
    from django_dbworker import enqueue

    items = [enqueue("sleep", {"key": f"s{n}", "seconds": 0.05}, max_attempts=1) for n in range(60)]
    victim = start_worker("sleep", "--concurrency", "1", env=FAST_STALE)
    claimed = WorkItem.objects.filter(pk__in=[i.pk for i in items], status=Status.CLAIMED)
    wait_until(lambda: claimed.count() >= 3, timeout=30, what="a buffer behind the running row")
    victim.signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    held = list(claimed.values_list("pk", flat=True))
    survivor = start_worker("sleep", env=FAST_STALE)
    rows = WorkItem.objects.filter(pk__in=held)
    wait_until(
        lambda: rows.filter(status=Status.FAILED).count() == len(held),
        timeout=30,
        what="stale recovery to end the dead worker's rows",
    )
    started = set(Execution.objects.filter(kind="start").values_list("key", flat=True))
    never_ran = [r for r in rows if r.payload["key"] not in started]
    assert never_ran, "every held row had started: no buffer was killed"
    assert all(r.attempts == 1 and "stale" in r.last_error for r in never_ran)
    survivor.signal(signal.SIGTERM)
    assert survivor.wait(30) == 0, survivor.log()


def test_a_worker_starts_without_warnings_about_its_own_models(start_worker) -> None:
    """Whatever the database (MySQL/MariaDB: Django warns that they ignore the work table's
    conditional indexes, W036/W037, which django-dbworker's MySQL migration answers), and
    whatever Django (6.1 runs the model checks against every alias), a start prints no
    check warnings; ``manage.py check --database`` still does."""
    worker = start_worker("noop", "--burst", env={"DBWORKER_TEST_UNSILENCED": "1"})
    assert worker.wait() == 0, worker.log()
    assert "System check identified" not in worker.log(), worker.log()
    assert "W036" not in worker.log() and "W037" not in worker.log(), worker.log()


# -- --reload: a code change restarts the worker, a stop ends both processes; both drain --

#: ``reloadapp/workers.py`` of the reloading project: records which version ran an item,
#: in which process, and holds an item while a file it names does not exist.
RELOAD_WORKERS = """
import os
import time
from pathlib import Path

from django_dbworker import WorkItemHandler
from tests.testapp.models import Execution


class Probe(WorkItemHandler):
    name = "reload_probe"

    def handle(self, payload):
        Execution.objects.create(key=payload["key"], kind={version!r}, pid=os.getpid())
        if "hold_until" in payload:
            deadline = time.monotonic() + 30
            while not Path(payload["hold_until"]).exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            Execution.objects.create(key=payload["key"], kind="end", pid=os.getpid())
"""


def _reloading_project(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """Settings that add an app under ``tmp_path`` (never the repository's files): its
    environment for the worker, and the path of its ``workers.py``."""
    app = tmp_path / "reloadapp"
    app.mkdir()
    (app / "__init__.py").write_text("")
    workers = app / "workers.py"
    workers.write_text(RELOAD_WORKERS.format(version="v1"))
    (tmp_path / "reload_settings.py").write_text(
        "from tests.settings import *  # noqa: F403\n"
        "INSTALLED_APPS = [*INSTALLED_APPS, 'reloadapp']  # noqa: F405\n"
    )
    env = {
        "DJANGO_SETTINGS_MODULE": "reload_settings",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "PYTHONDONTWRITEBYTECODE": "1",  # the edited module is read again, whatever its mtime
    }
    return env, workers


def _probe(key: str, **payload: str) -> WorkItem:
    # Not enqueue(): the handler is registered in the worker's process only.
    return WorkItem.objects.create(
        handler="reload_probe", payload={"key": key, **payload}, max_attempts=1
    )


def _ran(key: str) -> Execution:
    runs = Execution.objects.filter(key=key).exclude(kind="end")
    return wait_until(lambda: runs.first(), timeout=60, what=f"item {key!r} to run")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _edit_until_noticed(path: Path, worker, text: str) -> None:
    """Move ``path``'s mtime on until the worker logs ``text``.

    Django's watcher takes its first snapshot of the files after the worker
    started: an edit before it would be its baseline, not a change.
    """
    step = iter(range(1, 1000))

    def noticed() -> bool:
        if text in worker.log():
            return True
        later = time.time() + next(step)
        os.utime(path, (later, later))
        return False

    wait_until(noticed, timeout=60, interval=0.5, what=f"{text!r} in the worker log")


@pytest.mark.parametrize("stop", ["SIGTERM to the parent", "Ctrl-C in its terminal"])
def test_reload_restarts_on_a_code_change_and_a_stop_ends_both_processes(
    start_worker, tmp_path: Path, stop: str
) -> None:
    """A change restarts the worker in a new child, which runs the new code; the item the
    old child was running finishes there, once. A stop signal to the parent (or a
    terminal's Ctrl-C, which reaches parent and child) drains the child once, and both
    processes end. Django's own parent kills its child with SIGKILL on SIGTERM, and its
    child drops the worker's thread mid-item on a change: items left claimed."""
    env, workers = _reloading_project(tmp_path)
    terminal = stop.startswith("Ctrl-C")
    worker = start_worker("reload_probe", "--reload", env=env, new_session=terminal)
    children: list[int] = []
    try:
        _probe("first")
        old = _ran("first").pid
        children.append(old)
        assert old != worker.pid  # the parent only restarts the child that works
        assert "(reload)" in worker.log()

        held = _probe("held", hold_until=str(tmp_path / "release-held"))
        _ran("held")
        workers.write_text(RELOAD_WORKERS.format(version="v2"))
        _edit_until_noticed(workers, worker, "Code changed: finishing running items")
        (tmp_path / "release-held").touch()
        wait_until(
            lambda: worker.log().count("Starting worker:") == 2,
            timeout=60,
            what="a new child to start",
        )
        _probe("after")
        after = _ran("after")
        children.append(after.pid)
        assert (after.kind, after.pid != old, after.pid != worker.pid) == ("v2", True, True)
        assert WorkItem.objects.get(pk=held.pk).status == Status.SUCCEEDED
        assert set(Execution.objects.filter(key="held").values_list("kind", "pid")) == {
            ("v1", old),
            ("end", old),
        }
        assert not _alive(old)

        last = _probe("last", hold_until=str(tmp_path / "release-last"))
        _ran("last")
        if terminal:
            os.killpg(worker.pid, signal.SIGINT)
        else:
            worker.signal(signal.SIGTERM)
        worker.wait_for_log("SIGTERM received: finishing running items")
        assert worker.proc.poll() is None and _alive(after.pid)  # draining
        (tmp_path / "release-last").touch()
        assert worker.wait(timeout=30) == 0, worker.log()
        wait_until(lambda: not _alive(after.pid), timeout=10, what="the child to end")
        assert WorkItem.objects.get(pk=last.pk).status == Status.SUCCEEDED
        assert not WorkItem.objects.filter(status=Status.CLAIMED).exists()
        assert Execution.objects.filter(kind__in=("v1", "v2")).count() == 4  # each item once
        assert "received again" not in worker.log()
    finally:
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
