"""Batches and ``after=`` across ``run_workers`` processes (SPEC "Batches and
dependencies"), on every database of the run.

The items are ``step`` handlers, which write a start and an end record
(``Execution``) per run: the order of the runs is read from those records,
whose ids the database hands out in commit order of causally ordered
inserts (a child's start is inserted after its parent's end committed),
and from their times. The batch's own proof is its rows: one callback
row, its counts equal to the items' final states, written (DB clock) no
earlier than the last item's ``finished_at``, run once.

Under chaos, stale recovery is fast (``STALE_AFTER`` 1 s, heartbeats
every 0.2 s), so the rows of a SIGKILLed worker come back within about two
seconds. Elsewhere no worker dies, and stale recovery, whose pass also
runs ``completion.sweep`` (the safety net that completes a batch no
ending completed), is slow (``STALE_AFTER`` an hour: a pass at start-up,
the next after 48 s or more): a completion the endings missed then shows
as a timed-out wait (30 s), not as a late callback from the sweep. On
PostgreSQL the batch row's ``xmin`` shows it completed in the transaction
that wrote the ending of one of its items. No test asserts a duration.
"""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Callable, Iterable

import pytest
from django.db import connection, transaction
from django.db.models import Max

from django_dbworker import batch
from django_dbworker.batches.models import Batch
from django_dbworker.models import Status, WorkItem
from tests.conftest import WorkerProcess, wait_until
from tests.testapp.models import Execution
from tests.testapp.workers import BatchDone, KillWorker, Step

pytestmark = pytest.mark.django_db(transaction=True)

FAST_STALE = {"DBWORKER_STALE_AFTER": "1.0", "DBWORKER_HEARTBEAT_INTERVAL": "0.2"}
#: Stale recovery, and so the sweep, once at start-up and then not for 48 s or more.
NO_SWEEP = {"DBWORKER_STALE_AFTER": "3600"}
#: How long the tests without chaos wait for an outcome: well before the next sweep.
WAIT = 30.0
HANDLERS = ("step", "batch_done")
FINAL = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)

StartWorker = Callable[..., WorkerProcess]


def _start(
    start_worker: StartWorker, n: int, *args: str, env: dict[str, str] = NO_SWEEP
) -> list[WorkerProcess]:
    workers = [start_worker(*HANDLERS, *args, env=env) for _ in range(n)]
    for worker in workers:
        worker.wait_for_log("Starting worker", timeout=60)
    return workers


def _stop(workers: Iterable[WorkerProcess]) -> None:
    workers = list(workers)
    for worker in workers:
        worker.signal(signal.SIGTERM)
    for worker in workers:
        assert worker.wait(timeout=60) == 0, worker.log()


def _callbacks(batch_id: int) -> list[WorkItem]:
    return list(WorkItem.objects.filter(handler="batch_done", payload__batch=batch_id))


def _callback_ran(batch_id: int) -> bool:
    return WorkItem.objects.filter(
        handler="batch_done", payload__batch=batch_id, status=Status.SUCCEEDED
    ).exists()


def _assert_completed_once(batch_id: int) -> dict[str, int]:
    """The batch's one callback: its counts are the items' final states, its row was
    written no earlier than the last item ended (DB clock), it ran once. Returns the counts."""
    items = WorkItem.objects.filter(batch_id=batch_id)
    states = Counter(items.values_list("status", flat=True))
    assert set(states) <= set(FINAL), states
    counts = {
        "succeeded": states[Status.SUCCEEDED],
        "failed": states[Status.FAILED],
        "cancelled": states[Status.CANCELLED],
    }
    row = Batch.objects.get(pk=batch_id)
    assert row.total == sum(states.values())
    assert row.completed_at is not None
    assert (row.succeeded, row.failed, row.cancelled) == tuple(counts.values())
    callbacks = _callbacks(batch_id)
    assert len(callbacks) == 1, [c.pk for c in callbacks]
    (callback,) = callbacks
    assert callback.pk == row.callback_id
    assert callback.payload == {**row.payload, "batch": batch_id, **counts}
    last_ended = items.aggregate(last=Max("finished_at"))["last"]
    assert last_ended is not None
    assert callback.created_at >= last_ended, (callback.created_at, last_ended)
    assert callback.status == Status.SUCCEEDED
    assert Execution.objects.filter(key=f"batch:{batch_id}", kind="callback").count() == 1
    if connection.vendor == "postgresql":
        _assert_completed_by_an_ending(batch_id)
    return counts


def _xmins(table: str, where: str, value: int) -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT xmin::text FROM {table} WHERE {where} = %s", [value])
        return {row[0] for row in cursor.fetchall()}


def _assert_one_transaction(*items: WorkItem) -> None:
    """PostgreSQL: the final states of ``items`` were written by one transaction (a
    failure and the cancellations it set off, not a later sweep)."""
    if connection.vendor == "postgresql":
        xmins = [_xmins(WorkItem._meta.db_table, "id", item.pk) for item in items]
        assert all(x == xmins[0] for x in xmins), (
            f"the endings of {[item.payload['key'] for item in items]} were written by "
            f"different transactions (xmin {xmins}): a cancellation was not its cause's"
        )


def _assert_completed_by_an_ending(batch_id: int) -> None:
    """PostgreSQL: the batch row was last written (completed_at, callback_id) by the
    transaction that wrote the final state of one of its items (which nothing writes
    after): the completion was that ending's, not a later sweep's. (``xmin`` names the
    subtransaction: the endings write the item and the batch under one savepoint.)"""
    (completed_by,) = _xmins(Batch._meta.db_table, "id", batch_id)
    assert completed_by in _xmins(WorkItem._meta.db_table, "batch_id", batch_id), (
        "the batch was not completed in the transaction of one of its items' endings"
    )


def _records(keys: Iterable[str]) -> dict[tuple[str, str], list[Execution]]:
    """The start and end records of ``keys``, by (key, kind), in insertion order."""
    found: dict[tuple[str, str], list[Execution]] = {}
    for record in Execution.objects.filter(key__in=list(keys)).order_by("id"):
        found.setdefault((record.key, record.kind), []).append(record)
    return found


def _assert_runs_after(
    records: dict[tuple[str, str], list[Execution]], child: str, parents: Iterable[str]
) -> None:
    """``child`` ran once, and started after every one of ``parents`` ended."""
    (start,) = records[(child, "start")]
    assert len(records[(child, "end")]) == 1
    for parent in parents:
        (end,) = records[(parent, "end")]
        assert end.id < start.id, f"{child} started before {parent} ended"
        assert end.created_at <= start.created_at, f"{child} started before {parent} ended"


def test_a_batch_under_sigkill_chaos_enqueues_one_callback_with_the_right_counts(
    start_worker: StartWorker,
) -> None:
    """200 items over 3 workers, which are stopped and replaced while the batch runs, each
    while it holds claimed rows: four SIGKILLed (their rows left to stale recovery), two
    SIGTERMed past a 0.1 s shutdown timeout (their rows released). An operator cancels
    the last ten items; one item in ten fails for good. (Four kills, five attempts: no
    item runs out of attempts.)"""
    n = 200
    args = (*HANDLERS, "--concurrency", "2", "--shutdown-timeout", "0.1")
    workers = [start_worker(*args, env=FAST_STALE) for _ in range(3)]
    for worker in workers:
        worker.wait_for_log("Starting worker", timeout=60)
    with batch(on_complete=BatchDone, payload={"run": "chaos"}) as b:
        items = Step.enqueue_many(
            [{"key": f"i{k}", "seconds": 0.05, "fail": k % 10 == 3} for k in range(n)]
        )
    assert b.total == n
    ended = WorkItem.objects.filter(batch_id=b.id, status__in=FINAL)
    kill, term = signal.SIGKILL, signal.SIGTERM
    for threshold, signum in (
        (20, kill),
        (45, term),
        (70, kill),
        (100, term),
        (130, kill),
        (160, kill),
    ):
        wait_until(lambda t=threshold: ended.count() >= t, timeout=60, what=f"{threshold} ended")
        if threshold == 45:
            # An operator cancels ten of the last items: pending ones end
            # cancelled, claimed ones are asked to stop (the handler ignores it).
            WorkItem.objects.filter(pk__in=[item.pk for item in items[-10:]]).cancel()

        def busy() -> WorkerProcess | None:
            # A live, started worker that holds claimed rows of the batch.
            for worker in workers:
                if (
                    worker.proc.poll() is None
                    and "Starting worker" in worker.log()
                    and WorkItem.objects.filter(
                        batch_id=b.id, status=Status.CLAIMED, claimed_by__contains=f":{worker.pid}:"
                    ).exists()
                ):
                    return worker
            return None

        victim = wait_until(busy, timeout=30, what="a worker holding claimed items")
        victim.signal(signum)
        assert victim.wait() == (-kill if signum == kill else 0), victim.log()
        workers.remove(victim)
        workers.append(start_worker(*args, env=FAST_STALE))
    wait_until(lambda: _callback_ran(b.id), timeout=90, what="the batch's callback to run")
    for worker in workers:
        worker.wait_for_log("Starting worker", timeout=60)
    _stop(workers)

    counts = _assert_completed_once(b.id)
    assert sum(counts.values()) == n
    # Every item but the cancelled ten ended as its handler decided, killed or not.
    kept = {item.pk: item.payload["fail"] for item in items[:-10]}
    states = dict(WorkItem.objects.filter(pk__in=kept).values_list("pk", "status"))
    assert {pk: states[pk] == Status.FAILED for pk in kept} == kept
    assert set(states.values()) == {Status.SUCCEEDED, Status.FAILED}
    # The kills were real: rows of the killed workers were recovered and run again.
    recovered = WorkItem.objects.filter(batch_id=b.id, error_history__isnull=False)
    assert any(
        "Recovered as stale" in entry["error"]
        for history in recovered.values_list("error_history", flat=True)
        for entry in history
    ), "no item of a killed worker was recovered"


def test_many_batches_finishing_at_once_get_one_callback_each(
    start_worker: StartWorker,
) -> None:
    """60 batches of 3 items, committed at once to 3 idle workers that run one item at a
    time and claim no more (no prefetch): consecutive items, so a batch's items, run on
    different workers side by side, and its last two end at about the same moment; every
    third batch has an item that fails."""
    batches, size = 60, 3
    env = {**NO_SWEEP, "DBWORKER_PREFETCH_HORIZON": "0"}
    workers = _start(start_worker, 3, "--concurrency", "1", env=env)
    expected: dict[int, dict[str, int]] = {}
    with transaction.atomic():
        for n in range(batches):
            failing = n % 3 == 0
            with batch(on_complete=BatchDone, payload={"n": n}) as b:
                Step.enqueue_many(
                    [
                        {"key": f"b{n}-{k}", "seconds": 0.02, "fail": failing and k == n % size}
                        for k in range(size)
                    ]
                )
            expected[b.id] = {"succeeded": size - failing, "failed": int(failing)}
    wait_until(
        lambda: all(_callback_ran(pk) for pk in expected),
        timeout=WAIT,
        what="every batch's callback to run",
    )
    _stop(workers)
    for pk, want in expected.items():
        counts = _assert_completed_once(pk)
        assert counts == {**want, "cancelled": 0}, (pk, counts)
    assert WorkItem.objects.filter(handler="batch_done").count() == batches


@pytest.mark.pgbouncer
def test_a_chain_and_a_fan_in_run_in_order(start_worker: StartWorker) -> None:
    """A chain of 20 links (each ``after=`` the previous) and one item after 10 parents,
    over 3 workers: every child started after each of its parents ended."""
    workers = _start(start_worker, 3, "--concurrency", "2")
    links, fan = 20, 10
    with transaction.atomic():
        previous = Step.enqueue({"key": "link0"})
        for k in range(1, links):
            previous = Step.enqueue({"key": f"link{k}"}, after=[previous])
        parents = Step.enqueue_many([{"key": f"parent{k}", "seconds": 0.05} for k in range(fan)])
        Step.enqueue({"key": "fan-in"}, after=parents)
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == links + fan + 1,
        timeout=WAIT,
        what="the chain and the fan-in to succeed",
    )
    _stop(workers)
    records = _records(
        [f"link{k}" for k in range(links)] + [f"parent{k}" for k in range(fan)] + ["fan-in"]
    )
    for k in range(1, links):
        _assert_runs_after(records, f"link{k}", [f"link{k - 1}"])
    _assert_runs_after(records, "fan-in", [f"parent{k}" for k in range(fan)])
    assert Execution.objects.filter(kind="start").count() == links + fan + 1


def test_items_enqueued_after_parents_that_are_running_or_ending_run_in_order(
    start_worker: StartWorker,
) -> None:
    """A chain enqueued one link at a time, each as soon as its parent started, with
    fan-ins beside it, over 3 workers: each ``after=`` meets its parents claimed,
    ending or ended (their row lock and ``has_dependents`` decide who settles the child).
    None is left waiting (no sweep runs here), and each child started after its parents
    ended."""
    workers = _start(start_worker, 3, "--concurrency", "2")
    links = 30
    chain = [Step.enqueue({"key": "c0"})]
    fans: dict[str, list[str]] = {}
    started = Execution.objects.filter(kind="start")
    for k in range(1, links):
        parent = chain[-1].payload["key"]
        wait_until(
            lambda p=parent: started.filter(key=p).exists(),
            timeout=WAIT,
            interval=0.002,
            what=f"{parent} to start",
        )
        # Parents of 0 to 20 ms: the child's enqueue lands anywhere in their ending.
        chain.append(Step.enqueue({"key": f"c{k}", "seconds": 0.005 * (k % 5)}, after=[chain[-1]]))
        if k % 6 == 0:
            parents = chain[-3:]
            Step.enqueue({"key": f"fan{k}"}, after=parents)
            fans[f"fan{k}"] = [item.payload["key"] for item in parents]
    total = links + len(fans)
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == total,
        timeout=WAIT,
        what="every item to succeed (a child left waiting times out here)",
    )
    _stop(workers)
    records = _records([f"c{k}" for k in range(links)] + list(fans))
    for k in range(1, links):
        _assert_runs_after(records, f"c{k}", [f"c{k - 1}"])
    for fan, parents in fans.items():
        _assert_runs_after(records, fan, parents)


def test_a_failed_parent_cancels_its_dependents_transitively_and_none_of_them_runs(
    start_worker: StartWorker,
) -> None:
    """``bad`` fails for good: ``c1`` (after it), ``c2`` (after c1), ``c3`` (after ``ok`` and
    ``bad``) and ``c4`` (after c2 and c3) end cancelled unrun; ``s`` (after ``ok``) runs.
    An operator cancels ``w1`` while it waits for ``slow`` (which runs until the test
    opens its gate): ``w2`` (after w1) is cancelled too, ``slow`` still succeeds. All in
    one batch, whose callback counts them."""
    workers = _start(start_worker, 2, "--concurrency", "2")
    with batch(on_complete=BatchDone) as b:
        bad = Step.enqueue({"key": "bad", "seconds": 0.2, "fail": True})
        ok = Step.enqueue({"key": "ok"})
        c1 = Step.enqueue({"key": "c1"}, after=[bad])
        c2 = Step.enqueue({"key": "c2"}, after=[c1])
        c3 = Step.enqueue({"key": "c3"}, after=[ok, bad])
        c4 = Step.enqueue({"key": "c4"}, after=[c2, c3])
        s = Step.enqueue({"key": "s"}, after=[ok])
        slow = Step.enqueue({"key": "slow", "gate": "slow"})
        w1 = Step.enqueue({"key": "w1"}, after=[slow])
        w2 = Step.enqueue({"key": "w2"}, after=[w1])
    wait_until(
        lambda: Execution.objects.filter(key="slow", kind="start").exists(),
        timeout=WAIT,
        what="slow to start",
    )
    assert WorkItem.objects.get(pk=w1.pk).cancel()
    Execution.objects.create(key="slow", kind="open")  # slow may end now
    wait_until(lambda: _callback_ran(b.id), timeout=WAIT, what="the batch's callback to run")
    _stop(workers)

    rows = {row.pk: row for row in WorkItem.objects.filter(batch_id=b.id)}
    assert rows[bad.pk].status == Status.FAILED
    assert rows[ok.pk].status == rows[s.pk].status == rows[slow.pk].status == Status.SUCCEEDED
    blamed = {
        c1: [(bad, "failed")],
        c2: [(c1, "cancelled")],
        c3: [(bad, "failed")],
        c4: [(c2, "cancelled"), (c3, "cancelled")],
        w2: [(w1, "cancelled")],
    }
    for child, parents in blamed.items():
        row = rows[child.pk]
        assert (row.status, row.waiting, row.attempts, row.claimed_at) == (
            Status.CANCELLED,
            False,
            0,
            None,
        ), child.payload
        assert row.finished_at is not None
        assert any(
            f"work item #{parent.pk}, which ended {state}" in row.last_error
            for parent, state in parents
        ), (child.payload, row.last_error)
    assert (rows[w1.pk].status, rows[w1.pk].attempts) == (Status.CANCELLED, 0)
    assert not Execution.objects.filter(key__in=["c1", "c2", "c3", "c4", "w1", "w2"]).exists()
    _assert_one_transaction(bad, c1, c2, c3, c4)
    records = _records(["ok", "s"])
    _assert_runs_after(records, "s", ["ok"])
    counts = _assert_completed_once(b.id)
    assert counts == {"succeeded": 3, "failed": 1, "cancelled": 6}


def test_dependents_of_items_that_kill_their_workers_follow_the_recovered_outcome(
    start_worker: StartWorker,
) -> None:
    """``k`` kills its worker on its first run and succeeds on the next: ``c`` (after it)
    runs after that. ``doom`` kills its worker on every run, until stale recovery fails it
    (attempts used up): ``d1`` (after it) and ``d2`` (after d1) end cancelled unrun. One
    batch holds them all.

    ``doom`` runs in a queue of its own, on a one-thread worker of its own: on a worker
    that also ran ``k``, its SIGKILL could come before ``k``'s success was written (the
    success writer commits after the thread moved on), which would run ``k`` again.
    Each worker is replaced when it dies.
    """
    env = {**FAST_STALE, "DBWORKER_PREFETCH_HORIZON": "0"}
    plain = (*HANDLERS, "kill_worker", "--concurrency", "1", "--queue", "default")
    dooms = ("kill_worker", "--concurrency", "1", "--queue", "doom")
    workers = {start_worker(*plain, env=env): plain, start_worker(*dooms, env=env): dooms}
    for worker in workers:
        worker.wait_for_log("Starting worker", timeout=60)
    with batch(on_complete=BatchDone) as b:
        a = Step.enqueue({"key": "a"})
        k = KillWorker.enqueue({"key": "k", "times": 1}, after=[a])
        c = Step.enqueue({"key": "c"}, after=[k])
        doom = KillWorker.enqueue({"key": "doom"}, after=[a], queue="doom")
        d1 = Step.enqueue({"key": "d1"}, after=[doom])
        d2 = Step.enqueue({"key": "d2"}, after=[d1])
    deaths = 0

    def done() -> bool:
        nonlocal deaths
        for worker, args in list(workers.items()):
            if worker.proc.poll() is not None:
                assert worker.proc.returncode == -signal.SIGKILL, worker.log()
                deaths += 1
                del workers[worker]
                workers[start_worker(*args, env=env)] = args
        return _callback_ran(b.id)

    wait_until(done, timeout=90, what="the batch's callback to run")
    for worker in workers:
        worker.wait_for_log("Starting worker", timeout=60)
    _stop(workers)

    rows = {row.pk: row for row in WorkItem.objects.filter(batch_id=b.id)}
    assert [rows[item.pk].status for item in (a, k, c)] == [Status.SUCCEEDED] * 3
    assert rows[k.pk].attempts == 2
    assert (rows[doom.pk].status, rows[doom.pk].attempts) == (Status.FAILED, 3)
    assert "attempts used up" in rows[doom.pk].last_error
    assert deaths == 4  # k once, doom three times
    runs = list(Execution.objects.order_by("id").values_list("id", "key", "kind"))
    assert [key for _, key, _ in runs].count("k") == 2
    assert [key for _, key, _ in runs].count("doom") == 3
    last_k = max(pk for pk, key, _ in runs if key == "k")
    first_c = min(pk for pk, key, kind in runs if key == "c" and kind == "start")
    assert last_k < first_c, "c started before k's surviving run"
    assert rows[k.pk].finished_at <= rows[c.pk].claimed_at
    for child, parent in ((d1, doom), (d2, d1)):
        row = rows[child.pk]
        assert (row.status, row.attempts, row.claimed_at) == (Status.CANCELLED, 0, None)
        state = "failed" if parent is doom else "cancelled"
        assert f"work item #{parent.pk}, which ended {state}" in row.last_error, row.last_error
    assert not Execution.objects.filter(key__in=["d1", "d2"]).exists()
    _assert_one_transaction(doom, d1, d2)
    counts = _assert_completed_once(b.id)
    assert counts == {"succeeded": 3, "failed": 1, "cancelled": 2}


def _enqueue_then_roll_back() -> None:
    with batch(on_complete=BatchDone, payload={"block": "rolled back"}):
        Step.enqueue({"key": "rolled-back"})
        raise RuntimeError("the block rolls back")


def test_an_empty_batch_runs_its_callback_once_and_a_rolled_back_block_leaves_nothing(
    start_worker: StartWorker,
) -> None:
    workers = _start(start_worker, 1)
    with pytest.raises(RuntimeError, match="rolls back"):
        _enqueue_then_roll_back()
    with batch(on_complete=BatchDone, payload={"block": "empty"}) as empty:
        pass
    wait_until(lambda: _callback_ran(empty.id), timeout=WAIT, what="the empty batch's callback")
    _stop(workers)
    (row,) = Batch.objects.all()
    assert row.pk == empty.id and row.total == 0
    (callback,) = WorkItem.objects.all()
    assert callback.payload == {
        "block": "empty",
        "batch": empty.id,
        "succeeded": 0,
        "failed": 0,
        "cancelled": 0,
    }
    assert list(Execution.objects.values_list("key", "kind")) == [(f"batch:{empty.id}", "callback")]


def test_an_item_retried_after_its_batch_completed_runs_again_without_a_second_callback(
    start_worker: StartWorker,
) -> None:
    """A completed batch stays completed: an operator's retry of one of its items runs the
    item again, and its new ending enqueues no callback and leaves the counts as they were
    at completion."""
    workers = _start(start_worker, 1)
    with batch(on_complete=BatchDone) as b:
        bad = Step.enqueue({"key": "bad", "fail": True})
        Step.enqueue({"key": "good"})
    wait_until(lambda: _callback_ran(b.id), timeout=WAIT, what="the batch's callback to run")
    completed = _assert_completed_once(b.id)
    assert completed == {"succeeded": 1, "failed": 1, "cancelled": 0}
    assert WorkItem.objects.get(pk=bad.pk).retry()
    starts = Execution.objects.filter(key="bad", kind="start")
    wait_until(
        lambda: starts.count() == 2 and WorkItem.objects.get(pk=bad.pk).status == Status.FAILED,
        timeout=WAIT,
        what="the retried item to fail again",
    )
    _stop(workers)
    assert WorkItem.objects.get(pk=bad.pk).attempts == 1  # the retry reset it to 0
    row = Batch.objects.get(pk=b.id)
    assert (row.succeeded, row.failed, row.cancelled) == (1, 1, 0)
    (callback,) = _callbacks(b.id)
    assert callback.pk == row.callback_id
    assert {key: callback.payload[key] for key in completed} == completed
    assert Execution.objects.filter(key=f"batch:{b.id}", kind="callback").count() == 1
