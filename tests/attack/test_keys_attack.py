"""Attacks on per-key concurrency limits (issue 21): each test here failed on h-keys.

Every test runs against a real database (no mocks of the DB); waits are
bounded (``wait_until``, lock waits observed in the server's own tables).
A test that fails on one vendor only says which in its docstring.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import pytest
from django.db import connection, connections, transaction

from django_dbworker import WorkItemHandler
from django_dbworker.models import Status, WorkItem
from tests.conftest import wait_until
from tests.factories import assert_no_key_overlaps, claim
from tests.testapp.models import Execution
from tests.testapp.workers import Keyed, Noop, _record

pytestmark = pytest.mark.django_db(transaction=True)

HANDLERS = ["keyed", "keyed_pair", "noop"]


class KeyedTimeout(WorkItemHandler):
    """One item per key at once, abandoned after 0.5 s: records its start and end, then sleeps."""

    name = "attack_keyed_timeout"
    concurrency_limit = 1
    timeout = 0.5
    max_attempts = 1

    def handle(self, payload: Any) -> None:
        _record(payload, "start")
        time.sleep(float(payload.get("seconds", 0)))
        _record(payload, "end")


def keyed_claim(limit: int = 10, worker: str = "attack:1:main") -> list[WorkItem]:
    return claim(limit=limit, handlers=HANDLERS, worker=worker, limited=True)


def claimed_of(handler: str, key: str) -> list[int]:
    """Ids of the claimed rows of exactly (handler, key), compared in Python (byte for byte)."""
    rows = WorkItem.objects.filter(status=Status.CLAIMED, handler=handler).values_list(
        "pk", "concurrency_key"
    )
    return sorted(pk for pk, k in rows if k == key)


def lock_waiters() -> int:
    """Transactions of this database server waiting for a lock right now."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
        else:
            cursor.execute(
                "SELECT count(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'"
            )
        (n,) = cursor.fetchone()
    return int(n)


# -- keys compare byte for byte ---------------------------------------------------


def test_keys_differing_only_in_case_accent_or_trailing_space_are_different_keys() -> None:
    """MariaDB: ``concurrency_key`` has the table's utf8mb4_unicode_ci (PAD SPACE) collation.

    README: "Names compare byte for byte" (migration 0005 gives handler,
    queue and unique_key a binary NO PAD collation); PostgreSQL and SQLite
    compare keys byte for byte, and ``within_limits`` keys its counts by the
    Python strings. On MariaDB the claim's key filter compares with the
    case-, accent- and trailing-space-insensitive collation: a claimed
    ``"A"`` holds back ``"a"``, ``"Ä"`` and ``"A "``, keys of other items.
    """
    first = Keyed.enqueue({"key": "A"}, concurrency_key="A")
    assert [i.pk for i in keyed_claim()] == [first.pk]
    others = [Keyed.enqueue({"key": k}, concurrency_key=k) for k in ("a", "Ä", "A ")]
    got = keyed_claim()
    assert sorted(i.pk for i in got) == sorted(i.pk for i in others), (
        "rows of keys 'a', 'Ä', 'A ' were held back by a claimed row of key 'A': "
        f"claimed {[i.pk for i in got]} of {[i.pk for i in others]}"
    )


@pytest.mark.server_db
def test_a_race_never_claims_two_rows_of_a_key_with_limit_one_when_a_case_variant_is_held(
    background_worker: Any,
) -> None:
    """MariaDB: the slot count of key "A" comes back under the name "a", so "A" reads as free.

    Claimer Z claims a row of key "a" and one of key "A" (different keys,
    both fit) and has not committed; claimer X has locked a second row of
    "A" as a candidate (its key filter saw no claimed row yet) and waits for
    the key's FlowLock row. When Z commits, X counts the claimed rows of
    ("keyed", "A"): under the case-insensitive collation the count groups
    "a" and "A" together and names the group "a" (the first row in the
    index), so ``held[("keyed", "A")]`` is missing, read as 0, and X claims
    the second row of "A": two claimed rows of a key whose limit is 1.
    """
    small_a = Keyed.enqueue({"key": "a"}, concurrency_key="a")
    big_a1 = Keyed.enqueue({"key": "A"}, concurrency_key="A")
    big_a2 = Keyed.enqueue({"key": "A"}, concurrency_key="A")

    z_claimed = threading.Event()
    z_commit = threading.Event()
    z_out: list[list[int]] = []
    x_out: list[list[int]] = []
    errors: list[BaseException] = []

    def z() -> None:
        try:
            with transaction.atomic():
                got = keyed_claim(limit=2, worker="attack:z")
                z_out.append(sorted(i.pk for i in got))
                z_claimed.set()
                assert z_commit.wait(30)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            z_claimed.set()
        finally:
            connections.close_all()

    def x() -> None:
        try:
            x_out.append(sorted(i.pk for i in keyed_claim(limit=10, worker="attack:x")))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    tz = threading.Thread(target=z)
    tz.start()
    assert z_claimed.wait(30)
    assert not errors, errors
    assert z_out == [sorted([small_a.pk, big_a1.pk])]
    tx = threading.Thread(target=x)
    tx.start()
    try:
        wait_until(lambda: lock_waiters() >= 1, timeout=20, what="claimer X to wait for a lock")
    finally:
        z_commit.set()
        tz.join(30)
        tx.join(30)
    assert not errors, errors
    assert claimed_of("keyed", "A") == [big_a1.pk], (
        f"key 'A' (limit 1) has claimed rows {claimed_of('keyed', 'A')}; "
        f"X claimed {x_out}, row {big_a2.pk} is the second row of 'A'"
    )


@pytest.mark.postgres_only
def test_the_keyed_claim_holds_the_limit_at_repeatable_read() -> None:
    """PostgreSQL at REPEATABLE READ (``OPTIONS["isolation_level"]`` or the server's
    ``default_transaction_isolation``): the slot count reads the claim's first snapshot.

    Claimer Z has claimed the key's only slot and not yet committed; claimer
    X (a session at REPEATABLE READ) locks the key's second row as a
    candidate, waits for the FlowLock row, and once Z commits counts the
    claimed rows in the snapshot its transaction took before Z's commit: 0.
    X claims the second row: two claimed rows of a key whose limit is 1.
    The MySQL claim sets READ COMMITTED for itself (``_read_committed``);
    the PostgreSQL one does not, and raises nothing: the limit is simply
    broken.
    """
    import psycopg

    from django_dbworker.db import operations

    # The key was used before: its FlowLock row exists (Z only locks it).
    Keyed.enqueue({"key": "K"}, concurrency_key="K")
    (used,) = keyed_claim(limit=1)
    assert used.claim_token is not None
    operations().succeed_many([(used.pk, used.claim_token, None)])
    first = Keyed.enqueue({"key": "K"}, concurrency_key="K")
    Keyed.enqueue({"key": "K"}, concurrency_key="K")

    z_claimed, z_commit = threading.Event(), threading.Event()
    out: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def z() -> None:
        try:
            with transaction.atomic():
                out["z"] = [i.pk for i in keyed_claim(limit=1, worker="attack:z")]
                z_claimed.set()
                assert z_commit.wait(30)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            z_claimed.set()
        finally:
            connections.close_all()

    def x() -> None:
        try:
            connection.ensure_connection()
            connection.connection.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            out["x"] = [i.pk for i in keyed_claim(limit=5, worker="attack:x")]
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    tz = threading.Thread(target=z)
    tz.start()
    assert z_claimed.wait(30)
    assert out.get("z") == [first.pk], (out, errors)
    tx = threading.Thread(target=x)
    tx.start()
    try:
        wait_until(lambda: lock_waiters() >= 1, timeout=20, what="claimer X to wait for a lock")
    finally:
        z_commit.set()
        tz.join(30)
        tx.join(30)
    assert not errors, errors
    assert claimed_of("keyed", "K") == [first.pk], (
        f"key 'K' (limit 1) has claimed rows {claimed_of('keyed', 'K')}; X claimed {out.get('x')}"
    )


# -- the limit on the row ---------------------------------------------------------


def test_rows_keep_their_stored_limit_when_a_deploy_drops_the_handlers_limit(
    background_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row's concurrency_limit is ignored when the worker's handlers declare none.

    ``enqueue_options._concurrency_columns``: "rows of one key enqueued
    before a deploy that changed it keep the limit they were enqueued
    with", and ``within_limits`` honours the row's limit. But the claim
    loop picks the keyed claim only when one of its handlers declares a
    limit now (``claim_loop.py``: ``limited=any(h.concurrency_limit ...)``):
    after a deploy that sets the limit to None, rows stored with limit 1
    run side by side (while a worker that also serves another limited
    handler would still honour it).
    """
    for n in range(3):
        Keyed.enqueue({"key": "deploy", "seconds": 0.5, "n": n}, concurrency_key="deploy")
    assert set(WorkItem.objects.values_list("concurrency_limit", flat=True)) == {1}
    monkeypatch.setattr(Keyed, "concurrency_limit", None)  # the deploy
    background_worker(["keyed"], concurrency=3)
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == 3,
        timeout=30,
        what="the three items to succeed",
    )
    assert_no_key_overlaps()


def test_after_a_limit_is_raised_older_rows_of_the_key_are_not_overtaken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows keep the limit they were enqueued with: a raised limit lets newer rows pass older ones.

    Three rows of key R enqueued at limit 1, then a deploy raises the
    handler's limit to 3 and ten more rows come. A worker that finishes
    one row and claims again, round after round, keeps the key busy: each
    old row (limit 1) sees 2 claimed rows of its key and is skipped, each
    new row (limit 3) fits, so the old rows wait behind every newer row of
    their key (and would wait for ever under steady load: the key must
    drain to 0 claimed rows first). The claim order (priority, then age)
    is broken within the key.
    """
    old = [Keyed.enqueue({"key": "R", "n": n}, concurrency_key="R") for n in range(3)]
    monkeypatch.setattr(Keyed, "concurrency_limit", 3)  # the deploy
    new = [Keyed.enqueue({"key": "R", "n": 10 + n}, concurrency_key="R") for n in range(10)]
    from django_dbworker.db import operations

    order: list[int] = []
    held: list[WorkItem] = []
    for _ in range(12):
        got = keyed_claim(limit=10)
        order += [i.pk for i in got]
        held += got
        if held:
            done = held.pop(0)
            assert done.claim_token is not None
            operations().succeed_many([(done.pk, done.claim_token, None)])
    old_pks, new_pks = [o.pk for o in old], {n.pk for n in new}
    before_any_new = order[: next(i for i, pk in enumerate(order) if pk in new_pks)]
    assert before_any_new == old_pks, (
        f"claim order of key R {order}: old rows {old_pks} were overtaken by newer rows "
        f"{sorted(new_pks)}"
    )


def _rows_read_by(fn: Any) -> int:
    """Index and table rows the server read on this connection while ``fn`` ran."""
    if connection.vendor == "mysql":

        def handler_reads() -> int:
            with connection.cursor() as cursor:
                cursor.execute("SHOW SESSION STATUS LIKE 'Handler_read%%'")
                return sum(int(v) for _, v in cursor.fetchall())

        before = handler_reads()
        fn()
        return handler_reads() - before
    raise AssertionError(connection.vendor)


@pytest.mark.server_db
def test_a_claim_does_not_read_every_pending_row_of_a_key_at_its_limit() -> None:
    """Every claim, on every worker, walks the whole backlog of a hot key at its limit.

    20,000 pending rows of one key (limit 1, one of them claimed), one row
    of another key behind them. The candidates' key filter runs per row in
    claim order (a probe of the slot index per row), so finding the one
    claimable row reads all 20,000: on PostgreSQL "Rows Removed by Filter:
    19999" and 20,000 SubPlan loops (about 56 ms per claim here, linear in
    the hot key's backlog: a million-row burst for one customer costs every
    poll of every worker seconds). The plain claim reads one row. Still
    so on h-keys 008b678, whose filter probes a hashed list of the full keys
    per row instead of the slot index: cheaper per row, the same walk.
    """
    for _ in range(4):
        Keyed.enqueue_many([{"key": "hot"}] * 5000, concurrency_key="hot")
    assert len(keyed_claim(limit=1)) == 1  # the hot key is at its limit
    other = Keyed.enqueue({"key": "other"}, concurrency_key="other")
    if connection.vendor == "postgresql":
        import json

        from django_dbworker.db.postgresql_sql import candidates_statement

        with connection.cursor() as cursor:
            cursor.execute("ANALYZE django_dbworker_workitem")
        sql, params = candidates_statement(limit=4, handlers=HANDLERS, queues=None)
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
            (plan,) = cursor.fetchone()
        plan = json.loads(plan) if isinstance(plan, str) else plan

        def removed(node: dict[str, Any]) -> int:
            return int(node.get("Rows Removed by Filter", 0)) + sum(
                removed(child) for child in node.get("Plans", [])
            )

        read = removed(plan[0]["Plan"])
        got = [other.pk]
    else:
        out: list[list[WorkItem]] = []
        read = _rows_read_by(lambda: out.append(keyed_claim(limit=4)))
        got = [i.pk for i in out[0]]
    assert got == [other.pk]
    assert read < 1000, f"one claim read {read} rows to find the one claimable row"


@pytest.mark.postgres_only
def test_claims_of_unkeyed_rows_stay_one_statement_when_a_handler_declares_a_limit() -> None:
    """PostgreSQL: one concurrency_limit anywhere makes every claim four round trips.

    ``ClaimLoop`` runs the keyed claim whenever any handler the worker
    serves declares a limit (``run_workers`` serves every registered
    handler by default), also when no row has a key: BEGIN, the candidates,
    CLAIM_IDS, COMMIT, where the plain claim is one UPDATE ... RETURNING.
    The issue: "without slowing the common path".
    """
    from django.test.utils import CaptureQueriesContext

    for _ in range(3):
        Noop.enqueue()
        Keyed.enqueue({"key": "unkeyed"})
    with CaptureQueriesContext(connection) as plain:
        assert len(claim(limit=2, handlers=HANDLERS)) == 2
    with CaptureQueriesContext(connection) as keyed:
        assert len(keyed_claim(limit=2)) == 2
    assert len(plain.captured_queries) == 1
    assert [q["sql"].split()[0] for q in keyed.captured_queries] == ["UPDATE"], (
        "no row has a key, yet the claim took "
        f"{[q['sql'].split()[0] for q in keyed.captured_queries]}"
    )


# -- attempts that end while their handler still runs ----------------------------


def test_a_timed_out_attempt_does_not_free_its_keys_slot_while_its_handler_runs(
    background_worker: Any,
) -> None:
    """A timeout abandons the handler thread but frees the key's slot at once.

    The first item of key T runs 3 s in a handler with ``timeout = 0.5``:
    at 0.5 s the attempt is recorded failed (its row is no longer claimed)
    while its thread keeps running user code, and the second item of T
    starts beside it: two runs of a key whose limit is 1 overlap, from the
    handler's own records. (The late outcome is fenced, as the SPEC says;
    the run itself is not.)
    """
    KeyedTimeout.enqueue({"key": "T", "seconds": 3}, concurrency_key="T")
    KeyedTimeout.enqueue({"key": "T", "seconds": 0}, concurrency_key="T")
    background_worker(["attack_keyed_timeout"], concurrency=2)
    wait_until(
        lambda: Execution.objects.filter(key="T", kind="end").count() == 2,
        timeout=30,
        what="both runs of key T to end",
    )
    assert_no_key_overlaps()


@pytest.mark.server_db
def test_a_shutdown_release_does_not_free_a_running_items_slot_before_the_process_exits(
    start_worker: Any,
) -> None:
    """SIGTERM past --shutdown-timeout: the running row is released while its handler runs.

    Worker A runs the first item of key S (6 s). A's drain time ends, it
    releases the row to pending and then exits; between the two, its
    handler thread is still running, and worker B, woken by the release,
    starts the second item of S: two runs of a key whose limit is 1 at once
    (about 150 ms here, as long as A takes to exit after the release).
    """
    a = start_worker("keyed", "--shutdown-timeout", "0.5", "--interval", "0.1")
    a.wait_for_log("Starting worker", timeout=60)
    Keyed.enqueue({"key": "S", "seconds": 6}, concurrency_key="S")
    wait_until(
        lambda: Execution.objects.filter(key="S", kind="start").exists(),
        timeout=30,
        what="worker A to start the first item of S",
    )
    Keyed.enqueue({"key": "S", "seconds": 0}, concurrency_key="S")
    b = start_worker("keyed", "--interval", "0.1")
    b.wait_for_log("Starting worker", timeout=60)
    a.signal(signal.SIGTERM)
    wait_until(
        lambda: (
            a.proc.poll() is not None
            or Execution.objects.filter(key="S", kind="start").count() >= 2
        ),
        timeout=30,
        what="worker A to exit or worker B to start key S",
    )
    b_started_while_a_ran = a.proc.poll() is None
    assert a.wait(30) == 0, a.log()
    b.signal(signal.SIGTERM)
    assert b.wait(30) == 0, b.log()
    assert not b_started_while_a_ran, (
        "worker B started key S while worker A, which had released its running item of S, "
        f"was still running it:\n{a.log()}"
    )


@pytest.mark.mysql_only
def test_a_keys_finished_rows_do_not_make_its_claims_slower() -> None:
    """MariaDB: every claim of a key reads every row the key ever had, finished ones too.

    MySQL has no partial index, so ``dbworker_key_slots_idx`` is
    (handler, concurrency_key) over every row, without status: the key
    filter (once per candidate) and COUNT_KEY_SLOTS read each row of the
    key to test ``status = 'claimed'``. A long-lived key ("customer:42")
    with 20,000 succeeded rows still in the table: claiming its one pending
    row reads 40,000 index entries (the filter's 20,000 and the count's
    20,000), and it grows with the key's history until ``prune``.
    """
    for _ in range(4):
        Keyed.enqueue_many([{"key": "K"}] * 5000, concurrency_key="K")
    WorkItem.objects.filter(concurrency_key="K").update(status=Status.SUCCEEDED)
    pending = Keyed.enqueue({"key": "K"}, concurrency_key="K")
    out: list[list[WorkItem]] = []
    read = _rows_read_by(lambda: out.append(keyed_claim(limit=4)))
    assert [i.pk for i in out[0]] == [pending.pk]
    assert read < 1000, f"claiming the one pending row of key K read {read} index entries"
