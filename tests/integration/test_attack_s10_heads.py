"""Attacks on the key-driven keyed claim (``postgresql_keyed_sql.CLAIM_HEADS``, migration 0008).

1. The heads statement cuts its candidates to the claim's LIMIT *before* it locks them with
   SKIP LOCKED (``c``: ``p.id IN (SELECT ... LIMIT n) ... FOR UPDATE SKIP LOCKED``), where the
   walk and the plain claim lock first and count only the rows they got. A claimer beside
   another claim in flight picks the very rows the other holds, skips them all, and answers
   fewer rows than it asked for (``throttled`` 0): the claim loop reads that as "seen
   everything" (``claim_loop._ran_dry``) although the next rows are claimable; a burst
   worker exits with them pending.
2. HEADS_PLAN (``SET LOCAL enable_seqscan = off``, the claim's own transaction: every
   worker) cannot remove the seq scans of django_dbworker_queuestate; they stay, costed at
   1e10 each. The plan's cost (~2e10) then (a) hides every real cost difference under the
   planner's fuzz factor: ``c`` became a full ordered scan of dbworker_claim_idx, every
   pending row read per claim; and (b) passes every jit_*_above_cost: each claim is
   JIT-compiled with LLVM (~0.6 s a claim on a ten-row queue).

Both failed on 1dad2d5 (5 tests). Fixed: ``c`` locks the heads of every free key in claim
order with SKIP LOCKED below the LIMIT (and the unkeyed rows as they are read), and
HEADS_PLAN turns JIT off with the seq scans, the candidates locked by primary key from an
array. Every test here is now a regression test.
"""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext

from django_dbworker import pause_queue
from django_dbworker.db import operations
from django_dbworker.db.postgresql_keyed_sql import (
    KEYS_WALKED,
    candidates_statement,
    heads_statement,
)
from django_dbworker.models import Status, WorkItem
from django_dbworker.registry import registry
from django_dbworker.worker import Worker
from tests.factories import (
    HeldClaim,
    auto_explained_json,
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
LIMITS = {"keyed": 1, "keyed_pair": 2}


def explained_rows(sql: str, params: dict[str, Any]) -> int:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        (plan,) = cursor.fetchone()
        transaction.set_rollback(True)  # EXPLAIN ANALYZE locked the candidates
    plan = json.loads(plan) if isinstance(plan, str) else plan
    return rows_read(plan[0]["Plan"])


# -- a claim beside a claim in flight ----------------------------------------------------


@pytest.mark.parametrize("handlers", [MIXED, LIMITED], ids=["walk", "heads"])
def test_a_claim_beside_a_claim_in_flight_takes_the_next_keys(handlers: list[str]) -> None:
    """Six keys of one row each; a claim of 3 is in flight (rows of A, B, C locked, not yet
    committed). A second claimer of 3 must take D, E, F: they are claimable, and "keys of
    other items flow freely". The walk does; the heads answer nothing (and throttled 0, so
    the claim loop believes the queue empty and sleeps)."""
    rows = [Keyed.enqueue({"key": k}, concurrency_key=k) for k in "ABCDEF"]
    with HeldClaim(lambda: limited_claim(handlers, 3, worker="first")) as first:
        assert sorted(i.pk for i in first.out[0]) == [r.pk for r in rows[:3]]
        got = limited_claim(handlers, 3, worker="second")
        taken = sorted(i.pk for i in got)
        throttled = getattr(got, "throttled", 0)
    assert taken == [r.pk for r in rows[3:]], (
        f"second claim of 3 beside a claim in flight took {taken} (throttled {throttled}); "
        f"claimable: {[r.pk for r in rows[3:]]}"
    )


@pytest.mark.parametrize("handlers", [MIXED, LIMITED], ids=["walk", "heads"])
def test_unkeyed_rows_beside_a_claim_in_flight(handlers: list[str]) -> None:
    """The same with rows without a key of a limited handler (the heads' unkeyed branch)."""
    rows = [Keyed.enqueue({"key": "-"}) for _ in range(8)]
    with HeldClaim(lambda: limited_claim(handlers, 4, worker="first")):
        got = limited_claim(handlers, 4, worker="second")
        taken = sorted(i.pk for i in got)
    assert taken == [r.pk for r in rows[4:]], taken


@pytest.mark.parametrize("handlers", [MIXED, LIMITED], ids=["walk", "heads"])
def test_a_burst_worker_beside_a_claim_in_flight_runs_the_rows_it_can_claim(
    handlers: list[str],
) -> None:
    """20 rows without a key of a limited handler; another claimer holds the first 10 in
    a claim in flight. A burst worker ("process until nothing is claimable") must run the
    other 10. On the heads path its claim picks the held rows, skips them, comes back
    empty and not throttled: the worker exits at once, leaving 10 claimable rows."""
    for n in range(20):
        Keyed.enqueue({"key": "-", "n": n})
    worker = Worker(
        [registry[n] for n in handlers], worker_config(burst=True, concurrency=2, batch_size=4)
    )
    with HeldClaim(lambda: limited_claim(handlers, 10, worker="holder")):
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        thread.join(30)
        if thread.is_alive():
            worker.stop(immediate=True)
            thread.join(10)
            pytest.fail("the burst worker did not finish")
        ran = WorkItem.objects.filter(status=Status.SUCCEEDED).count()
    assert ran == 10, f"the burst worker ran {ran} of the 10 rows it could claim, then exited"


# -- what a claim reads ------------------------------------------------------------------


def _fill(cls: Any, n: int, **kw: Any) -> None:
    with transaction.atomic():
        for start in range(0, n, 1000):
            cls.enqueue_many([{"key": "b"}] * min(1000, n - start), **kw)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE django_dbworker_workitem")


def _reads(handlers: list[str], queues: list[str] | None, limit: int = 4) -> tuple[int, int]:
    limits = {h: LIMITS[h] for h in handlers if h in LIMITS}
    heads = heads_statement(limit=limit, handlers=handlers, queues=queues, limits=limits)
    assert heads is not None
    walk = candidates_statement(limit=limit, handlers=handlers, queues=queues, limits=limits)
    return explained_rows(*heads), explained_rows(*walk)


BACKLOG = 5000


def test_a_free_keys_backlog_in_another_queue_is_not_read_by_a_queue_worker() -> None:
    """A worker of queue q2; a key with BACKLOG rows in q1 (not at its limit: q1 has no
    worker now). The walk of q2 reads q2's index only; the heads descend into the key and
    filter its whole q1 backlog out, every claim."""
    _fill(Keyed, BACKLOG, concurrency_key="hot", queue="q1")
    mine = Keyed.enqueue({"key": "x"}, concurrency_key="x", queue="q2")
    heads, walk = _reads(["keyed"], ["q2"])
    assert walk < 100
    assert heads < 100, f"heads read {heads} rows for a claim of queue q2 (walk: {walk})"
    assert [i.pk for i in limited_claim(["keyed"], 4, queues=["q2"])] == [mine.pk]


def test_a_paused_queues_key_does_not_hide_the_rows_behind_it() -> None:
    """A free key whose rows all sit in a paused queue offers no head; the rows behind
    it are claimed (the heads read the paused backlog, as the walk does: not asserted)."""
    _fill(Keyed, 500, concurrency_key="hot", queue="q1")
    pause_queue("q1")
    mine = Keyed.enqueue({"key": "x"}, concurrency_key="x", queue="q2")
    assert [i.pk for i in limited_claim(["keyed"], 4)] == [mine.pk]


def test_other_queues_unkeyed_rows_are_not_read_by_a_queue_worker() -> None:
    _fill(Keyed, BACKLOG, queue="q1")
    mine = Keyed.enqueue({"key": "x"}, queue="q2")
    heads, walk = _reads(["keyed"], ["q2"])
    assert walk < 100
    assert heads < 100, f"heads read {heads} rows for a claim of queue q2 (walk: {walk})"
    assert [i.pk for i in limited_claim(["keyed"], 4, queues=["q2"])] == [mine.pk]


def heads_rows_read(run: Callable[[], Any]) -> tuple[Any, int]:
    result, plans = auto_explained_json(run)
    heads = [p for p in plans if "WITH RECURSIVE unkeyed" in p.get("Query Text", "")]
    assert len(heads) == 1, [p.get("Query Text", "")[:80] for p in plans]
    return result, rows_read(heads[0]["Plan"])


@pytest.mark.parametrize("inside", [True, False], ids=["callers_transaction", "own_transaction"])
def test_a_hot_keys_backlog_is_not_read_by_the_claim_a_worker_runs(inside: bool) -> None:
    """test_key_heads.py's hot key, measured on the statement as the claim runs it, not as a
    bare EXPLAIN: BACKLOG pending rows of one key at its limit, one row of another key.

    A worker's claim has its own transaction, where HEADS_PLAN sets enable_seqscan off.
    The disabled seq scan (of django_dbworker_queuestate, which the heads read) adds
    1e10 to the cost of every plan, so the planner no longer sees the cost of reading
    the table and orders ``c`` by a full scan of dbworker_claim_idx (a semi join with
    the candidates' ids): every pending row of the table is read, every claim (a claim
    behind 20,000 rows measured 1.45 s against 17.6 ms for the walk and 4 ms for the
    same statement inside a caller's transaction)."""
    with transaction.atomic():
        for _ in range(BACKLOG // 1000):
            Keyed.enqueue_many([{"key": "hot"}] * 1000, concurrency_key="hot")
    assert len(limited_claim(LIMITED, 1)) == 1  # the hot key is at its limit
    other = Keyed.enqueue({"key": "other"}, concurrency_key="other")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE django_dbworker_workitem")

    def run() -> Any:
        if inside:
            with transaction.atomic():
                return limited_claim(LIMITED, 4)
        return limited_claim(LIMITED, 4)

    got, read = heads_rows_read(run)
    assert [i.pk for i in got] == [other.pk]
    assert read < 100, f"the heads statement read {read} rows behind a hot key of {BACKLOG}"


def test_a_workers_claim_of_a_few_rows_is_not_jit_compiled() -> None:
    """HEADS_PLAN's ``enable_seqscan = off`` cannot take the seq scan of
    django_dbworker_queuestate (no index answers ``WHERE paused``) out of the plan: it stays,
    costed at 1e10, twice. The heads statement's estimated cost is then ~2e10, far past
    jit_above_cost / jit_inline_above_cost / jit_optimize_above_cost, so with PostgreSQL's
    default ``jit = on`` every claim of a worker (own transaction) compiles the statement
    with LLVM: about 0.6 s a claim of a queue of ten rows (3.9 ms with jit off)."""
    for n in range(10):
        Keyed.enqueue({"key": n}, concurrency_key=f"k{n}")
    got, plans = auto_explained_json(lambda: limited_claim(LIMITED, 4))
    assert len(got) == 4
    (heads,) = [p for p in plans if "WITH RECURSIVE unkeyed" in p.get("Query Text", "")]
    cost = heads["Plan"].get("Total Cost")
    jit = heads.get("JIT", {}).get("Timing", {}).get("Total")
    assert jit is None, (
        f"the heads statement was JIT-compiled: {jit} ms of {heads['Plan']['Actual Total Time']}"
        f" ms (estimated cost {cost})"
    )


# -- regression tests that held -----------------------------------------------------------


def test_racing_heads_and_walk_claimers_never_exceed_a_keys_limit() -> None:
    """Two heads claimers and a walk claimer on their own connections, the same keys of
    limits 1 and 2, while a fourth thread frees slots (succeeds held rows); many rounds.
    At the end of each round no key holds more claimed rows than its limit."""
    rnd = random.Random(10)
    keys = ["r0", "r1", "r2"]
    with transaction.atomic():
        for key in keys:
            Keyed.enqueue_many([{"key": key}] * 40, concurrency_key=key)
            KeyedPair.enqueue_many([{"n": 0}] * 40, concurrency_key=key)
        Noop.enqueue_many([{}] * 10)
    limits = {"keyed": 1, "keyed_pair": 2}
    for r in range(12):
        held = list(WorkItem.objects.filter(status=Status.CLAIMED))
        freeing = rnd.sample(held, k=rnd.randint(0, len(held)))
        barrier = threading.Barrier(4)
        errors: list[str] = []

        def run(
            job: Callable[[], Any],
            barrier: threading.Barrier = barrier,
            errors: list[str] = errors,
        ) -> None:
            try:
                connection.ensure_connection()
                barrier.wait(10)
                job()
            except Exception as exc:
                errors.append(repr(exc))
            finally:
                connections.close_all()

        def free(rows: list[WorkItem] = freeing) -> None:
            for row in rows:
                operations().succeed_many([(row.pk, row.claim_token, None)])

        jobs = [
            lambda r=r: limited_claim(LIMITED, rnd.randint(1, 5), worker=f"h1:{r}"),
            lambda r=r: limited_claim(LIMITED, rnd.randint(1, 5), worker=f"h2:{r}"),
            lambda r=r: limited_claim(MIXED, rnd.randint(1, 5), worker=f"w:{r}"),
            free,
        ]
        threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        counts = Counter(
            WorkItem.objects.filter(
                status=Status.CLAIMED, concurrency_key__isnull=False
            ).values_list("handler", "concurrency_key")
        )
        over = {hk: n for hk, n in counts.items() if n > limits[hk[0]]}
        assert not over, f"round {r}: keys over their limit {over}"


def _texts(run: Callable[[], Any]) -> tuple[Any, list[str]]:
    with CaptureQueriesContext(connection) as queries:
        result = run()
    return result, [q["sql"] for q in queries.captured_queries]


def _walked(texts: list[str]) -> bool:
    return any("r.rank <= l.lim" in t for t in texts)


@pytest.mark.parametrize(
    ("spread", "walks"),
    [
        ((KEYS_WALKED, 0), False),
        ((KEYS_WALKED + 1, 0), True),
        ((KEYS_WALKED // 2, KEYS_WALKED // 2 + 1), True),
    ],
    ids=["exactly", "one_more", "two_handlers"],
)
def test_the_fallback_at_keys_walked(spread: tuple[int, int], walks: bool) -> None:
    """KEYS_WALKED pending keys: the heads; one more (also over two handlers): the walk.
    Either way the claim takes the first keys' rows in claim order, one a key of limit 1
    (the second row of each key is behind every key's first)."""
    keyed, pair = spread
    with transaction.atomic():
        for n in range(keyed):
            Keyed.enqueue({"n": n}, concurrency_key=f"k{n:05}", priority=1)
        for n in range(pair):
            KeyedPair.enqueue({"n": n}, concurrency_key=f"p{n:05}")
        Keyed.enqueue_many([{"n": -1}] * 3, concurrency_key="k00000")
    first = sorted(WorkItem.objects.filter(status=Status.PENDING).values_list("id", flat=True))
    got, texts = _texts(lambda: limited_claim(LIMITED, 12))
    assert _walked(texts) is walks
    assert sorted(i.pk for i in got) == first[:12]
    assert getattr(got, "throttled", 0) == 0


def test_odd_keys_are_distinct_keys_on_the_heads_path() -> None:
    """Keys compare byte for byte: case, accents, spaces, quotes, 200 characters."""
    odd = [
        "a",
        "A",
        "Ä",
        "A ",
        " A",
        "a\u0308",
        "ä",
        "'",
        "%",
        "_",
        "\\",
        "x" * 200,
        "x" * 199,
        "日本",
        "k:1",
        "k",
        "k:",
        "ß",
        "ss",
        "\t",
    ]
    rows = {}
    for key in odd:
        rows[key] = [Keyed.enqueue({"key": key}, concurrency_key=key) for _ in range(2)]
    got = limited_claim(LIMITED, 50)
    assert sorted(i.pk for i in got) == sorted(r[0].pk for r in rows.values())
    assert getattr(got, "throttled", 0) == 0
    assert list(limited_claim(LIMITED, 50)) == []
