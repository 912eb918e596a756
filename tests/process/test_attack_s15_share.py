"""Attack s15 on the key share (``worker/peers.py``), with real ``run_workers`` processes.

Workers of one pool count each other in the register (``WorkerProcess``) and each holds
at most ``ceil(pending keys / live workers) + 1`` keyed rows. PostgreSQL only: the other
databases have no hand-over and no share.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from django.db import transaction
from prometheus_client.parser import text_string_to_metric_families

from django_dbworker import WorkItemHandler
from django_dbworker.flow_models import WorkerProcess as Registered
from django_dbworker.models import Status, WorkItem
from tests.conftest import ROOT, WorkerProcess, wait_until
from tests.factories import assert_no_key_overlaps
from tests.process.test_key_share import enqueue, keys_by_pid
from tests.testapp.models import Execution
from tests.testapp.workers import Keyed, _record

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]


class FivePerKey(WorkItemHandler):
    """Five items per concurrency key at once: records its start and end, then sleeps.

    Defined here, not in the test app: ``start_module_worker`` imports this module in the
    ``run_workers`` subprocess so that it knows the handler.
    """

    name = "s15_five_per_key"
    concurrency_limit = 5

    def handle(self, payload: Any) -> None:
        _record(payload, "start")
        time.sleep(float(payload.get("seconds", 0)))
        _record(payload, "end")


_RUN_WITH_THIS_MODULE = (
    "import sys, django; django.setup(); "
    "import tests.process.test_attack_s15_share; "
    "from django.core.management import execute_from_command_line; "
    "execute_from_command_line(['manage.py', 'run_workers', *sys.argv[1:]])"
)


class ModuleWorker(WorkerProcess):
    """``run_workers`` in a process that imported this module (its handlers)."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in wait()/kill()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _RUN_WITH_THIS_MODULE, *args],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )


@pytest.fixture
def start_module_worker(worker_env: dict[str, str], tmp_path: Path):
    started: list[ModuleWorker] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ModuleWorker:
        proc = ModuleWorker(
            list(args), {**worker_env, **(env or {})}, tmp_path / f"mworker-{len(started)}.log"
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()


def registered(worker: WorkerProcess) -> Registered | None:
    return Registered.objects.filter(name__contains=f":{worker.pid}:").first()


def starts_by_key() -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    for key, at in Execution.objects.filter(kind="start").values_list("key", "created_at"):
        found.setdefault(key, []).append(at.timestamp())
    return found


def widest(kinds: tuple[str, str] = ("start", "end")) -> int:
    """The most runs (of any keys) that were running at one moment, from the records."""
    running = most = 0
    for kind in (
        Execution.objects.filter(kind__in=kinds)
        .order_by("created_at", "id")
        .values_list("kind", flat=True)
    ):
        running += 1 if kind == "start" else -1
        most = max(most, running)
    return most


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def poll_cycles(port: int) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "worker_poll_cycles_total" and sample.labels == {
                "worker": "workitems"
            }:
                return sample.value
    return 0.0


# -- a draining worker registers again --------------------------------------------------


def test_a_draining_worker_stays_out_of_the_register(start_worker) -> None:
    """``runtime.py``: "claims no more: the others' shares grow now": the register row is
    deleted as the claim loop ends. But the heartbeat keeps beating through the drain
    (SHUTDOWN_TIMEOUT, running items), and ``KeyShare.beat`` takes the missing row for
    "deleted meanwhile (taken for dead): back in" and writes it again: the draining
    worker, which claims nothing more, counts as a live peer for the whole drain and
    halves its peers' shares."""
    env = {"DBWORKER_HEARTBEAT_INTERVAL": "0.2", "DBWORKER_SHUTDOWN_TIMEOUT": "20"}
    draining = start_worker("keyed", "--concurrency", "2", env=env)
    wait_until(lambda: registered(draining) is not None, what="the worker's register row")
    Keyed.enqueue({"key": "long", "seconds": 12}, concurrency_key="long")
    wait_until(
        lambda: Execution.objects.filter(key="long", kind="start").exists(),
        what="the long item to start",
    )
    first = registered(draining)
    assert first is not None
    draining.signal(signal.SIGTERM)
    draining.wait_for_log("Stopping: waiting up to")
    # Ten heartbeat intervals into the drain, the long item still runs (12 s).
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        time.sleep(0.1)
    assert draining.proc.poll() is None, draining.log()
    assert not Execution.objects.filter(key="long", kind="end").exists()
    row = registered(draining)
    assert row is None, (
        f"the draining worker is in the register again (started_at {row.started_at}, "
        f"first registered {first.started_at}, seen_at {row.seen_at})"
    )


# -- a peer with no free thread still takes half the keys ---------------------------------


def test_a_busy_peer_does_not_keep_free_keys_from_an_idle_worker(start_worker) -> None:
    """A worker of one thread, busy with a long item, counts as a live peer: the idle
    worker of 30 threads may hold ceil(30 / 2) + 1 = 16 of 30 free keys, and takes the
    other 14 one per RECOUNT_KEYS_EVERY (0.25 s) recount claim, with 14 threads idle
    meanwhile. The shares are meant to "add up to more than the keys, so a free key always
    fits someone's share", but the busy peer's share is no room at all."""
    busy = start_worker("keyed", "--concurrency", "1")
    wait_until(lambda: registered(busy) is not None, what="the busy worker's register row")
    Keyed.enqueue({"key": "long", "seconds": 30}, concurrency_key="long")
    wait_until(
        lambda: Execution.objects.filter(key="long", kind="start", pid=busy.pid).exists(),
        what="the long item to start on the one-thread worker",
    )
    port = free_port()
    idle = start_worker("keyed", "--concurrency", "30", "--metrics-port", str(port))
    wait_until(lambda: registered(idle) is not None, what="the idle worker's register row")
    # Its first claims found nothing (they counted 0 pending keys).
    wait_until(lambda: (poll_cycles(port) or 0) >= 2, what="the idle worker's first claims")
    with transaction.atomic():
        for k in range(30):
            Keyed.enqueue({"key": f"k{k}", "seconds": 20}, concurrency_key=f"k{k}")
    wait_until(
        lambda: Execution.objects.filter(kind="start").exclude(key="long").count() == 30,
        timeout=30,
        what="every one of the 30 keys to start",
    )
    times = sorted(t for key, ts in starts_by_key().items() if key != "long" for t in ts)
    spread = times[-1] - times[0]
    assert Execution.objects.filter(kind="start", pid=idle.pid).exclude(key="long").count() == 30
    # Thirty free keys, thirty free threads: they start together (a claim or two).
    assert spread < 1.5, f"the 30 free keys took {spread:.2f}s to start on 30 idle threads"


# -- idle workers poll faster than POLL_INTERVAL -----------------------------------------


def test_idle_workers_that_share_keys_poll_at_their_poll_interval(start_worker) -> None:
    """An idle worker waits POLL_INTERVAL between claims (LISTEN wakes it for new rows):
    "a quiet queue costs one query per interval per worker". With a peer in the register,
    an empty claim counts pending_keys 0, and the loop "recounts" every 0.25 s forever:
    each idle worker of a pool runs the key-driven claim (and a count of the register)
    four times a second with nothing to claim."""
    port = free_port()
    env = {"DBWORKER_POLL_INTERVAL": "2.0"}
    watched = start_worker("keyed", "--metrics-port", str(port), env=env)
    start_worker("keyed", env=env)
    wait_until(lambda: Registered.objects.count() == 2, what="both workers' register rows")
    wait_until(lambda: poll_cycles(port) is not None, what="the metrics server to answer")
    # Let the start-up wake-ups pass (each join notifies the queues; the listeners'
    # first wake-ups): a second.
    settle = time.monotonic() + 1.0
    while time.monotonic() < settle:
        time.sleep(0.1)
    before = poll_cycles(port)
    started = time.monotonic()
    while time.monotonic() < started + 4.0:  # two poll intervals of an idle worker
        time.sleep(0.1)
    after = poll_cycles(port)
    assert before is not None and after is not None
    assert watched.proc.poll() is None, watched.log()
    assert not WorkItem.objects.exists()
    # Two poll intervals: about 2 claims (a margin for a wake-up), not 16.
    assert after - before <= 4, f"{after - before:.0f} claims in 4 s by an idle worker"


# -- a handler of limit 5 is cut to the share of keys, not of slots -----------------------


def test_keys_of_a_higher_limit_use_their_slots_across_two_workers(start_module_worker) -> None:
    """Only keys of limit 1 are handed over (``handover.py``), so only they stick to the
    worker that first claimed them. Yet the share caps every limited handler's rows in
    keys: two workers of 10 threads and 4 keys of limit 5 (20 slots) may hold
    ceil(4 / 2) + 1 = 3 rows each, 6 of 20 slots, where before the change every thread
    ran (20 at once)."""
    workers = [start_module_worker("s15_five_per_key", "--concurrency", "10") for _ in range(2)]
    wait_until(lambda: Registered.objects.count() == 2, what="both workers' register rows")
    with transaction.atomic():
        for _ in range(40):
            for k in range(4):
                FivePerKey.enqueue({"key": f"k{k}", "seconds": 0.2}, concurrency_key=f"k{k}")
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == 160,
        timeout=60,
        what="every item to succeed",
    )
    for worker in workers:
        worker.signal(signal.SIGTERM)
    for worker in workers:
        assert worker.wait(timeout=30) == 0, worker.log()
    # 160 runs of 0.2 s on 20 slots and 20 threads: 8 rounds; the records show the width.
    most = widest()
    assert most >= 16, f"at most {most} of 20 slots (4 keys of limit 5, 20 threads) ran at once"


# -- keys no worker of the pool can claim now inflate the count ---------------------------


@pytest.mark.parametrize("elsewhere", ["none", "scheduled", "paused", "other_queue"])
def test_keys_that_cannot_run_now_do_not_keep_the_share_from_a_later_worker(
    start_worker, elsewhere: str
) -> None:
    """``test_a_worker_started_later_gets_its_share_of_the_keys`` with 60 more keys whose
    rows no worker of the pool can claim now: due in an hour (a retry's backoff, a
    snooze, a schedule), in a paused queue, or in a queue the pool does not serve. The
    key-driven claim counts them as pending keys all the same (``keys`` in CLAIM_HEADS
    reads every pending row of the handler: no run_after, paused or queue filter), so
    the first worker's share is ceil(100 / 2) + 1 = 51 and it keeps all 40 runnable keys
    by the hand-over while the second worker's 8 threads idle: the imbalance the share
    was made to end."""
    from datetime import timedelta

    from django_dbworker import pause_queue

    queue_args = ["--queue", "default"] if elsewhere == "other_queue" else []
    first = start_worker("keyed", "--concurrency", "8", *queue_args)
    wait_until(lambda: registered(first) is not None, what="the first worker's register row")
    if elsewhere == "paused":
        pause_queue("pausable", by="test")
    with transaction.atomic():
        for k in range(60 if elsewhere != "none" else 0):
            if elsewhere == "scheduled":
                Keyed.enqueue(
                    {"key": f"later{k}"}, concurrency_key=f"later{k}", run_after=timedelta(hours=1)
                )
            elif elsewhere == "paused":
                Keyed.enqueue({"key": f"later{k}"}, concurrency_key=f"later{k}", queue="pausable")
            else:
                Keyed.enqueue({"key": f"later{k}"}, concurrency_key=f"later{k}", queue="other")
    keys, per_key = 40, 60
    enqueue(keys, per_key, seconds=0.02)
    wait_until(
        lambda: len(keys_by_pid().get(first.pid, ())) == keys,
        timeout=60,
        what="the first worker to start a run of every key",
    )
    second = start_worker("keyed", "--concurrency", "8", *queue_args)
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == keys * per_key,
        timeout=60,
        what="every runnable keyed item to succeed",
    )
    for worker in (first, second):
        worker.signal(signal.SIGTERM)
    for worker in (first, second):
        assert worker.wait(timeout=30) == 0, worker.log()
    assert_no_key_overlaps()
    ran = {pid: len(found) for pid, found in keys_by_pid().items()}
    # As without the keys that cannot run: ceil(40 / 2) + 1 = 21 for the first at most.
    assert ran.get(second.pid, 0) >= 15, (
        f"the second worker ran items of {ran.get(second.pid, 0)} of {keys} keys ({ran})"
    )


# -- SIGTERM while the keys move to a new worker ------------------------------------------


def test_sigterm_while_the_keys_move_to_a_new_worker_runs_every_item_once(start_worker) -> None:
    """The first worker holds every key; a second one joins, the first cuts its hand-overs
    to its share and wakes the second; the first is stopped in the middle of that. Every
    item runs once, no two runs of a key overlap, nothing stays claimed."""
    keys, per_key = 40, 40
    first = start_worker("keyed", "--concurrency", "8")
    wait_until(lambda: registered(first) is not None, what="the first worker's register row")
    with transaction.atomic():
        for _ in range(per_key):
            for k in range(keys):
                Keyed.enqueue({"key": f"k{k}", "seconds": 0.02}, concurrency_key=f"k{k}")
    wait_until(
        lambda: len(keys_by_pid().get(first.pid, ())) == keys,
        timeout=60,
        what="the first worker to start a run of every key",
    )
    second = start_worker("keyed", "--concurrency", "8")
    wait_until(
        lambda: len(keys_by_pid().get(second.pid, ())) >= 5,
        timeout=30,
        what="the second worker to take some keys",
    )
    first.signal(signal.SIGTERM)
    assert first.wait(timeout=30) == 0, first.log()
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == keys * per_key,
        timeout=60,
        what="every keyed item to succeed",
    )
    second.signal(signal.SIGTERM)
    assert second.wait(timeout=30) == 0, second.log()
    assert_no_key_overlaps()
    assert set(WorkItem.objects.values_list("attempts", flat=True)) == {1}
    assert Execution.objects.filter(kind="start").count() == keys * per_key
    assert not WorkItem.objects.filter(status=Status.CLAIMED).exists()
    assert not Registered.objects.exists()
