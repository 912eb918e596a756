"""Attacks (session 11) on the fixed key-driven keyed claim (``CLAIM_HEADS``, 3913d24).

Bugs (these tests fail on 3913d24):

1. ``unkeyed`` locks up to LIMIT rows without a key (FOR UPDATE SKIP LOCKED as it reads
   them), but ``c`` keeps only the first LIMIT of heads + unkeyed: when the keys' heads
   outrank them, the unkeyed rows stay locked, unreturned and uncounted (``throttled``),
   until the claim commits. A claim beside it skips them all and comes back short (empty),
   not throttled: the claim loop believes the queue dry and a burst worker exits, leaving
   claimable rows. The walk locks only the rows it returns: the second claim takes them.
2. With AUTOCOMMIT off (``transaction.set_autocommit(False)``, outside atomic()), the keyed
   claim counts as "own" (``not in_atomic_block``) and sends HEADS_PLAN's ``SET LOCAL``:
   the caller's transaction (the claim does not commit it) runs on with seq scans and
   JIT off. The plain claim never sends CLAIM_PLAN there
   (test_attack_s7_claim_plan.test_manual_autocommit_off_never_sends_the_settings).
3. ``unkeyed`` looks for LIMIT unkeyed rows of the claim's handlers in
   dbworker_claim_unkeyed_idx, which holds every handler's: a limited worker whose rows all
   have keys reads every pending unkeyed row of every other handler, every claim, where the
   walk stops after its LIMIT ready rows.

All three failed on 3913d24 (4 tests). Fixed: the heads are keyed rows only (a ready row
without a key sends the claim to the walk, probed in dbworker_claim_unkeyed_idx, which now
leads with the handler), and HEADS_PLAN goes only where the claim's BEGIN opened the
transaction. Every test here is now a regression test.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.db.models.functions import Now
from django.utils import timezone

from django_dbworker import pause_queue, resume_queue
from django_dbworker.db import operations
from django_dbworker.db.postgresql_keyed_sql import candidates_statement, heads_statement
from django_dbworker.flow.models import QueueState
from django_dbworker.models import Status, WorkItem
from django_dbworker.registry import registry
from django_dbworker.transitions import release
from django_dbworker.worker import Worker
from tests.factories import (
    HeldClaim,
    handler_limits,
    limited_claim,
    rows_read,
    worker_config,
)
from tests.testapp.workers import Keyed, KeyedPair, Noop

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.postgres_only,
    pytest.mark.usefixtures("fresh_key_walk"),
]

LIMITED = ["keyed", "keyed_pair"]  # every handler limited: the heads
MIXED = ["keyed", "keyed_pair", "noop"]  # an unlimited handler too: the walk
BASE = datetime(2020, 1, 1, tzinfo=UTC)


def place(item: WorkItem, *, priority: int = 0, seconds: int = 0) -> WorkItem:
    WorkItem.objects.filter(pk=item.pk).update(
        priority=priority, run_after=BASE + timedelta(seconds=seconds)
    )
    return item


# -- 1. unkeyed rows locked and not returned ------------------------------------------------


def _keys_ahead_of_unkeyed(n: int) -> tuple[list[WorkItem], list[WorkItem]]:
    keyed = [
        place(Keyed.enqueue({"key": f"k{i}"}, concurrency_key=f"k{i}"), priority=5, seconds=i)
        for i in range(n)
    ]
    free = [place(Keyed.enqueue({"key": "-"}), priority=0, seconds=i) for i in range(n)]
    return keyed, free


@pytest.mark.parametrize("handlers", [MIXED, LIMITED], ids=["walk", "heads"])
def test_unkeyed_rows_behind_keyed_heads_are_claimable_beside_a_claim_in_flight(
    handlers: list[str],
) -> None:
    """Four keys of one row each at priority 5, four rows without a key at priority 0, all
    of the limited handler ``keyed``. A claim of 4 in flight takes the four keyed rows.
    A second claim of 4 must take the four unkeyed rows: nobody else claims them. On the
    heads path the first claim's ``unkeyed`` also locked them (not returned, not counted
    as throttled): the second claim skips them and answers nothing, not throttled."""
    keyed, free = _keys_ahead_of_unkeyed(4)
    with HeldClaim(lambda: limited_claim(handlers, 4, worker="first")) as first:
        assert sorted(i.pk for i in first.out[0]) == [r.pk for r in keyed]
        got = limited_claim(handlers, 4, worker="second")
        taken = sorted(i.pk for i in got)
        throttled = getattr(got, "throttled", 0)
    assert taken == [r.pk for r in free], (
        f"second claim of 4 beside a claim in flight took {taken} (throttled {throttled}); "
        f"claimable: {[r.pk for r in free]}"
    )


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.parametrize("handlers", [MIXED, LIMITED], ids=["walk", "heads"])
def test_a_worker_runs_the_unkeyed_rows_a_claim_in_flight_passed_over(
    handlers: list[str],
) -> None:
    """The same with a real worker (poll interval 30 s, LISTEN wakes it): while the claim
    of the keyed rows is in flight it must run the four unkeyed rows. On the heads path
    its claim comes back empty and not throttled (``_ran_dry``): it sleeps the poll
    interval with four claimable rows, which nothing wakes it for."""
    _keyed, free = _keys_ahead_of_unkeyed(4)
    worker = Worker(
        [registry[n] for n in handlers],
        worker_config(concurrency=2, batch_size=4, poll_interval=30.0),
    )

    def ran() -> list[int]:
        return sorted(WorkItem.objects.filter(status=Status.SUCCEEDED).values_list("pk", flat=True))

    with HeldClaim(lambda: limited_claim(handlers, 4, worker="holder")):
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        try:
            wait_for(lambda: len(ran()) >= len(free), 6.0)
            done = ran()
        finally:
            worker.stop(immediate=True)
            thread.join(20)
    assert not thread.is_alive()
    assert done == [r.pk for r in free], (
        f"in 6 s the worker ran {done}; claimable all along: {[r.pk for r in free]}"
    )


# -- 2. HEADS_PLAN in a caller's transaction (AUTOCOMMIT off) -------------------------------


def _show(name: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"SHOW {name}")
        return cursor.fetchone()[0]


def test_manual_autocommit_off_keeps_the_callers_planner_settings() -> None:
    """AUTOCOMMIT off, outside atomic(): the keyed claim runs in the caller's transaction,
    which it does not commit. Its SET LOCALs must not change how the caller's next
    statements are planned (the plain claim sends no CLAIM_PLAN there)."""
    Keyed.enqueue({"key": "a"}, concurrency_key="a")
    before = (_show("enable_seqscan"), _show("jit"))
    transaction.set_autocommit(False)
    try:
        got = limited_claim(LIMITED, 4)
        after = (_show("enable_seqscan"), _show("jit"))
        transaction.commit()
    finally:
        transaction.set_autocommit(True)
    assert len(got) == 1
    assert after == before, (
        f"after the keyed claim the caller's transaction runs with (enable_seqscan, jit) = "
        f"{after}, was {before}"
    )


def test_the_settings_end_with_the_claims_own_transaction() -> None:
    """Autocommit (a worker): the next statement on the connection plans as before, and
    a caller's atomic() block gets no settings either."""
    Keyed.enqueue({"key": "a"}, concurrency_key="a")
    Keyed.enqueue({"key": "b"}, concurrency_key="b")
    before = (_show("enable_seqscan"), _show("jit"))
    assert len(limited_claim(LIMITED, 1)) == 1
    assert (_show("enable_seqscan"), _show("jit")) == before
    with transaction.atomic():
        assert len(limited_claim(LIMITED, 1)) == 1
        assert (_show("enable_seqscan"), _show("jit")) == before
    assert list(limited_claim(LIMITED, 1)) == []  # empty claim: still its own transaction
    assert (_show("enable_seqscan"), _show("jit")) == before


# -- 3. another handler's unkeyed backlog --------------------------------------------------


def _copies(item: WorkItem, n: int, **changes: Any) -> None:
    """``n`` copies of ``item``'s row (new ids), in one statement, then ANALYZE."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_name = 'django_dbworker_workitem' AND column_name <> 'id'"
        )
        columns = [c for (c,) in cursor.fetchall()]
        values = [f"%({c})s" if c in changes else f"w.{c}" for c in columns]
        cursor.execute(
            f"INSERT INTO django_dbworker_workitem ({', '.join(columns)}) "
            f"SELECT {', '.join(values)} FROM django_dbworker_workitem AS w, "
            f"generate_series(1, %(n)s) AS g WHERE w.id = %(pk)s",
            {**changes, "n": n, "pk": item.pk},
        )
        cursor.execute("ANALYZE django_dbworker_workitem")


def explained_rows(sql: str, params: dict[str, Any], *, heads_plan: bool) -> int:
    with transaction.atomic(), connection.cursor() as cursor:
        if heads_plan:  # as the worker's claim runs it (its own transaction)
            cursor.execute("SET LOCAL enable_seqscan = off")
            cursor.execute("SET LOCAL jit = off")
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        (plan,) = cursor.fetchone()
        transaction.set_rollback(True)
    plan = json.loads(plan) if isinstance(plan, str) else plan
    return rows_read(plan[0]["Plan"])


OTHERS = 50_000


@pytest.mark.parametrize("ahead", [False, True], ids=["behind", "ahead"])
def test_another_handlers_unkeyed_backlog_costs_the_heads_no_more_than_the_walk(
    ahead: bool,
) -> None:
    """A worker of the limited handler ``keyed``, whose 20 ready rows all have keys (free
    keys, priority 5); beside it OTHERS pending rows without a key of ``noop`` (another
    worker's), priority 0 (behind) or 9 (ahead). A claim of 4: the walk reads its first
    4 rows (behind) or the backlog too (ahead: the same on both paths, not a regression).
    The heads' ``unkeyed`` looks for 4 unkeyed rows of ``keyed`` in
    dbworker_claim_unkeyed_idx, which holds noop's: it reads all OTHERS rows either way."""
    for n in range(20):
        place(Keyed.enqueue({"key": f"k{n}"}, concurrency_key=f"k{n}"), priority=5, seconds=n)
    template = Noop.enqueue()
    _copies(template, OTHERS - 1, priority=9 if ahead else 0)
    WorkItem.objects.filter(pk=template.pk).update(priority=9 if ahead else 0)
    limits = handler_limits(["keyed"])
    heads = heads_statement(limit=4, handlers=["keyed"], queues=None, limits=limits)
    assert heads is not None
    walk = candidates_statement(limit=4, handlers=["keyed"], queues=None, limits=limits)
    heads_read = explained_rows(*heads, heads_plan=True)
    walk_read = explained_rows(*walk, heads_plan=False)
    got = limited_claim(["keyed"], 4)
    assert len(got) == 4
    assert heads_read <= max(200, 2 * walk_read), (
        f"the heads read {heads_read} rows for a claim of 4; the walk {walk_read}"
    )


# -- held: the heads against a brute-force model ----------------------------------------------


def model(limit: int, queues: list[str] | None, limits: dict[str, int]) -> list[int]:
    """What the claim should take: the ready rows in claim order, a key offering its first
    rows up to its free slots (current limits); ``limit``. With a ready row without a key
    the claim walks instead (ce11b1f on: the heads are keyed rows only)."""
    now = timezone.now()
    paused = set(QueueState.objects.filter(paused=True).values_list("name", flat=True))
    held = Counter(
        WorkItem.objects.filter(status=Status.CLAIMED, concurrency_key__isnull=False).values_list(
            "handler", "concurrency_key"
        )
    )
    rows = [
        r
        for r in WorkItem.objects.filter(status=Status.PENDING, handler__in=LIMITED).values_list(
            "id", "handler", "concurrency_key", "priority", "run_after", "queue"
        )
        if r[4] <= now and r[5] not in paused and (not queues or r[5] in queues)
    ]
    rows.sort(key=lambda r: (-r[3], r[4], r[0]))
    offered: Counter[tuple[str, str]] = Counter()
    out = []
    if any(r[2] is None for r in rows):
        # A ready row without a key: the claim walks (the next ``limit`` ready rows but
        # keys at their limit, then those that fit).
        walked = [r for r in rows if r[2] is None or held[(r[1], r[2])] < limits[r[1]]]
        for pk, handler, key, *_ in walked[:limit]:
            if key is not None:
                offered[(handler, key)] += 1
                if offered[(handler, key)] > limits[handler] - held[(handler, key)]:
                    continue
            out.append(pk)
        return out
    for pk, handler, key, *_ in rows:
        if key is not None:
            offered[(handler, key)] += 1
            if offered[(handler, key)] > limits[handler] - held[(handler, key)]:
                continue
        out.append(pk)
    return out[:limit]


def test_the_heads_claim_what_a_brute_force_model_claims(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Random tables (two limited handlers, four keys and none, priorities and run_after
    with ties, rows not yet due, three queues, one paused at times, slots held, limits
    raised and lowered below the slots held); random claims (limit, queues) on the heads
    path against the model, then the limits never exceeded."""
    rnd = random.Random(11)
    taken = 0
    for round_ in range(25):
        WorkItem.objects.all().delete()
        QueueState.objects.all().delete()
        monkeypatch.setattr(Keyed, "concurrency_limit", 1)
        monkeypatch.setattr(KeyedPair, "concurrency_limit", 2)
        for _ in range(rnd.randint(5, 30)):
            cls = rnd.choice([Keyed, KeyedPair])
            key = rnd.choice([None, "A", "B", "C", "D"])
            queue = rnd.choice(["q1", "q2", "q3"])
            item = cls.enqueue({"key": key or "-"}, concurrency_key=key, queue=queue)
            place(item, priority=rnd.randint(0, 2), seconds=rnd.randint(0, 5))
            if rnd.random() < 0.15:
                WorkItem.objects.filter(pk=item.pk).update(
                    run_after=timezone.now() + timedelta(hours=1)
                )
        for _ in range(rnd.randint(0, 2)):
            limited_claim(LIMITED, rnd.randint(1, 4), worker="pre")
        monkeypatch.setattr(Keyed, "concurrency_limit", rnd.choice([1, 1, 2, 3]))
        monkeypatch.setattr(KeyedPair, "concurrency_limit", rnd.choice([1, 2, 2, 3]))
        if rnd.random() < 0.3:
            pause_queue("q3")
        for _ in range(3):
            queues = rnd.choice([None, ["q1"], ["q1", "q2"], ["q3"], ["q2", "q3"]])
            limit = rnd.randint(1, 8)
            limits = handler_limits(LIMITED)
            want = model(limit, queues, limits)
            unkeyed = WorkItem.objects.filter(
                status=Status.PENDING, handler__in=LIMITED, concurrency_key__isnull=True
            ).exists()
            got = limited_claim(LIMITED, limit, queues=queues)
            assert sorted(i.pk for i in got) == sorted(want), (round_, limit, queues, limits)
            if not unkeyed:  # the heads: a key offers its free slots, nothing is held back
                assert getattr(got, "throttled", 0) == 0, (round_, limit, queues, limits)
            taken += len(got)
        resume_queue("q3")
    assert taken > 50, taken


# -- held: many claimers, slots freed, rows released and recovered ---------------------------


def test_racing_claimers_with_releases_and_recovery_never_exceed_a_keys_limit() -> None:
    """Two heads claimers and a walk claimer claim without pause while a churner succeeds,
    releases and (heartbeat aged) recovers claimed rows; a monitor counts each key's
    claimed rows in every snapshot it takes. No snapshot may show a key over its limit."""
    from django_dbworker.stale import recover_stale

    keys = [f"r{n}" for n in range(5)]
    with transaction.atomic():
        for key in keys:
            Keyed.enqueue_many([{"key": key}] * 30, concurrency_key=key)
            KeyedPair.enqueue_many([{"n": 0}] * 30, concurrency_key=key)
        Keyed.enqueue_many([{"key": "-"}] * 30)
        Noop.enqueue_many([{}] * 20)
    limits = {"keyed": 1, "keyed_pair": 2}
    stop = threading.Event()
    errors: list[str] = []
    over: list[Any] = []
    snapshots = [0]
    claims = Counter[str]()

    def loop(body: Callable[[random.Random], None], seed: int) -> None:
        rnd = random.Random(seed)
        try:
            while not stop.is_set():
                body(rnd)
        except Exception as exc:
            errors.append(repr(exc))
            stop.set()
        finally:
            connections.close_all()

    def claimer(handlers: list[str], name: str) -> Callable[[random.Random], None]:
        def body(rnd: random.Random) -> None:
            got = limited_claim(handlers, rnd.randint(1, 3), worker=name)
            claims[name] += len(got)

        return body

    def churn(rnd: random.Random) -> None:
        held = list(WorkItem.objects.filter(status=Status.CLAIMED).order_by("?")[:3])
        for item in held:
            what = rnd.random()
            if what < 0.4:
                operations().succeed_many([(item.pk, item.claim_token, None)])
            elif what < 0.7:
                release([item])
            else:
                WorkItem.objects.filter(pk=item.pk).update(heartbeat_at=Now() - timedelta(hours=1))
                recover_stale(stale_after=60, log=False)

    def monitor(rnd: random.Random) -> None:
        counts = Counter(
            WorkItem.objects.filter(
                status=Status.CLAIMED, concurrency_key__isnull=False
            ).values_list("handler", "concurrency_key")
        )
        snapshots[0] += 1
        bad = {hk: n for hk, n in counts.items() if n > limits[hk[0]]}
        if bad:
            over.append(bad)
            stop.set()

    bodies = [
        claimer(LIMITED, "h1"),
        claimer(LIMITED, "h2"),
        claimer(MIXED, "w"),
        churn,
        monitor,
    ]
    threads = [
        threading.Thread(target=loop, args=(b, n), daemon=True) for n, b in enumerate(bodies)
    ]
    for t in threads:
        t.start()
    stop.wait(5.0)
    stop.set()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert not over, f"keys over their limit: {over[:3]}"
    assert claims["h1"] and claims["h2"] and claims["w"] and snapshots[0] > 10, (claims, snapshots)


# -- held: the walk after the fallback, in the transaction HEADS_PLAN set -------------------


def test_the_fallback_walk_under_heads_plan_reads_no_more_than_the_walk() -> None:
    """Past KEYS_WALKED keys the walk runs in the transaction where HEADS_PLAN turned seq
    scans off; with a hot key's backlog and 5,000 rows of another handler it must read no
    more than the walk as planned normally."""
    with transaction.atomic():
        for n in range(1100):
            Keyed.enqueue({"n": n}, concurrency_key=f"k{n:05}")
    template = Noop.enqueue()
    _copies(template, 4999)
    limits = handler_limits(["keyed"])
    walk = candidates_statement(limit=4, handlers=["keyed"], queues=None, limits=limits)
    plain = explained_rows(*walk, heads_plan=False)
    pinned = explained_rows(*walk, heads_plan=True)
    assert pinned <= max(200, 2 * plain), (pinned, plain)
    assert len(limited_claim(["keyed"], 4)) == 4
    assert operations()._walk_keys_until > time.monotonic()
