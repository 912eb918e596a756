"""Per-key concurrency limits on a real database: enqueue, the keyed claim, slots and races.

Also the documented limits of the feature (docs/topics/flow-control.md, as
strict xfails): what a claim reads behind a hot key, what a limited handler
costs the others, and that a limit holds while the worker owns the attempt.

A slot is a claimed row of a (handler, concurrency_key): these tests claim
through the vendor operations directly (``tests.factories.claim``), so
each statement's effect on the table is what is checked. The race test
runs two claimers on their own connections (threads), many rounds.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, connections, transaction

from django_dbworker import EnqueueError, WorkItemHandler, enqueue, enqueue_many, pause_queue
from django_dbworker.checks import concurrency_limit_errors
from django_dbworker.db import operations
from django_dbworker.flow.models import FlowLock
from django_dbworker.models import Status, WorkItem
from django_dbworker.registry import registry
from django_dbworker.worker import Worker
from tests.conftest import lock_waiters as shared_lock_waiters
from tests.conftest import wait_until
from tests.factories import age_heartbeat, assert_no_key_overlaps, claim
from tests.testapp.models import Execution
from tests.testapp.workers import Keyed, KeyedPair, Noop, _record

pytestmark = pytest.mark.django_db(transaction=True)

HANDLERS = ["keyed", "keyed_pair", "noop"]


def keyed_claim(limit: int = 10, worker: str = "test:1:main") -> list[WorkItem]:
    return claim(limit=limit, handlers=HANDLERS, worker=worker, limited=True)


def claimed_keys() -> list[tuple[str, str | None]]:
    return sorted(
        WorkItem.objects.filter(status=Status.CLAIMED).values_list("handler", "concurrency_key")
    )


def succeed(item: WorkItem) -> None:
    assert item.claim_token is not None
    assert operations().succeed_many([(item.pk, item.claim_token, None)]) == {
        (item.pk, item.claim_token)
    }


# -- enqueue ------------------------------------------------------------------------


def test_enqueue_stores_the_key_and_the_handlers_limit() -> None:
    item = Keyed.enqueue({"key": "a"}, concurrency_key="customer:42")
    row = WorkItem.objects.get(pk=item.pk)
    assert (row.concurrency_key, row.concurrency_limit) == ("customer:42", 1)
    plain = Keyed.enqueue({"key": "b"})
    row = WorkItem.objects.get(pk=plain.pk)
    assert (row.concurrency_key, row.concurrency_limit) == (None, None)


def test_a_key_without_a_handler_limit_is_stored_unlimited() -> None:
    item = Noop.enqueue(concurrency_key="k")
    row = WorkItem.objects.get(pk=item.pk)
    assert (row.concurrency_key, row.concurrency_limit) == ("k", None)


@pytest.mark.parametrize("count", [1, 3, 150])  # 150: PostgreSQL's COPY path
def test_enqueue_many_carries_the_key_and_limit_on_every_row(count: int) -> None:
    items = KeyedPair.enqueue_many([{"n": i} for i in range(count)], concurrency_key="batch")
    rows = WorkItem.objects.filter(pk__in=[i.pk for i in items])
    assert sorted(set(rows.values_list("concurrency_key", "concurrency_limit"))) == [("batch", 2)]
    assert rows.count() == count


def test_module_level_enqueue_functions_take_the_key() -> None:
    one = enqueue("keyed", {"key": "x"}, concurrency_key="k1")
    many = enqueue_many("keyed", [{"key": "y"}], concurrency_key="k2")
    assert WorkItem.objects.get(pk=one.pk).concurrency_key == "k1"
    assert WorkItem.objects.get(pk=many[0].pk).concurrency_key == "k2"


@pytest.mark.parametrize("key", [5, b"k", "", "x" * 201, ["k"], True])
def test_a_bad_concurrency_key_is_refused_writing_nothing(key: Any) -> None:
    with pytest.raises(EnqueueError, match="concurrency_key must be a string of 1 to 200"):
        Keyed.enqueue({"key": "a"}, concurrency_key=key)
    with pytest.raises(EnqueueError, match="concurrency_key must be a string of 1 to 200"):
        Keyed.enqueue_many([{"key": "a"}, {"key": "b"}], concurrency_key=key)
    with pytest.raises(EnqueueError, match="concurrency_key must be a string of 1 to 200"):
        enqueue("keyed", {"key": "a"}, concurrency_key=key)
    assert not WorkItem.objects.exists()


def test_a_key_of_200_characters_is_fine() -> None:
    Keyed.enqueue({"key": "a"}, concurrency_key="k" * 200)
    assert WorkItem.objects.get().concurrency_key == "k" * 200


@pytest.mark.parametrize("limit", [0, -1, "2", True, 1.5, 2**31])
def test_a_bad_concurrency_limit_is_a_check_error_and_refuses_keyed_enqueues(limit: Any) -> None:
    class Bad(WorkItemHandler):
        name = "bad_limit"
        concurrency_limit = limit

    try:
        errors = concurrency_limit_errors([Bad, Keyed, Noop])
        assert [e.id for e in errors] == ["django_dbworker.E021"]
        assert "bad_limit" in errors[0].msg and "concurrency_limit" in errors[0].msg
        with pytest.raises(EnqueueError, match="bad concurrency_limit"):
            Bad.enqueue({}, concurrency_key="k")
        assert not WorkItem.objects.exists()
    finally:
        registry.unregister("bad_limit")


# -- the keyed claim ------------------------------------------------------------------


def test_a_key_at_its_limit_is_skipped_and_rows_behind_it_are_claimed() -> None:
    a = [Keyed.enqueue({"key": f"a{i}"}, concurrency_key="A") for i in range(3)]
    b = Keyed.enqueue({"key": "b"}, concurrency_key="B")
    free = Noop.enqueue()
    got = keyed_claim()
    assert sorted(i.pk for i in got) == sorted([a[0].pk, b.pk, free.pk])
    if connection.vendor != "sqlite":  # SQLite's one statement does not say
        assert getattr(got, "throttled", None) == 2
    # The key is at its limit: nothing more of it, whatever the batch size.
    assert keyed_claim() == []
    assert set(
        WorkItem.objects.filter(pk__in=[a[1].pk, a[2].pk]).values_list("status", "attempts")
    ) == {
        (Status.PENDING, 0)  # waiting is not an attempt
    }
    # Its slot frees when its claimed row finishes: the next one goes.
    succeed(next(i for i in got if i.pk == a[0].pk))
    assert [i.pk for i in keyed_claim()] == [a[1].pk]


def test_a_hot_key_does_not_hold_back_the_rows_behind_it() -> None:
    hot = [Keyed.enqueue({"key": f"h{i}"}, concurrency_key="hot") for i in range(30)]
    others = [Keyed.enqueue({"key": f"o{i}"}, concurrency_key=f"k{i}") for i in range(5)]
    plain = [Noop.enqueue() for _ in range(3)]
    first = keyed_claim(limit=5)
    assert [i.pk for i in first] == [hot[0].pk]
    second = keyed_claim(limit=8)
    assert sorted(i.pk for i in second) == sorted(i.pk for i in others + plain)


@pytest.mark.postgres_only
def test_the_candidates_of_a_key_beyond_its_limit_stay_locked_and_are_not_sent_back() -> None:
    """PostgreSQL: the candidate statement returns a key's rows up to its limit only.

    W7 (100 keys, limit 1) locked 500 candidates per claim to claim 100; all
    500 went to the worker and into CLAIM_WITHIN_LIMITS (its arrays, window
    function and join: 6 of a claim's 16 ms). The rest stay locked until
    the claim commits, and are counted as held back (``throttled``).
    """
    from django_dbworker.db.postgresql_keyed_sql import candidates_statement

    a = [Keyed.enqueue({"key": f"a{i}"}, concurrency_key="A") for i in range(4)]
    p = [KeyedPair.enqueue({"n": i}, concurrency_key="P") for i in range(4)]
    free = Noop.enqueue()
    sql, params = candidates_statement(
        limit=9, handlers=HANDLERS, queues=None, limits={"keyed": 1, "keyed_pair": 2}
    )
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    assert [r[0] for r in rows] == [a[0].pk, p[0].pk, p[1].pk, free.pk]
    assert {r[-1] for r in rows} == {9}  # every row says how many the statement locked
    got = keyed_claim(limit=9)
    assert sorted(i.pk for i in got) == sorted([a[0].pk, p[0].pk, p[1].pk, free.pk])
    assert getattr(got, "throttled", None) == 5


def test_a_limit_of_two_allows_two_claimed_rows_of_a_key() -> None:
    rows = [KeyedPair.enqueue({"n": i}, concurrency_key="p") for i in range(5)]
    assert [i.pk for i in keyed_claim()] == [rows[0].pk, rows[1].pk]
    assert keyed_claim() == []
    assert claimed_keys() == [("keyed_pair", "p"), ("keyed_pair", "p")]


def test_the_same_key_of_two_handlers_is_two_keys() -> None:
    k = Keyed.enqueue({"key": "1"}, concurrency_key="same")
    p = KeyedPair.enqueue({"n": 1}, concurrency_key="same")
    assert sorted(i.pk for i in keyed_claim()) == sorted([k.pk, p.pk])


def test_a_key_without_a_limit_is_not_limited() -> None:
    rows = [Noop.enqueue(concurrency_key="free") for _ in range(4)]
    assert sorted(i.pk for i in keyed_claim()) == [r.pk for r in rows]


def test_the_plain_claim_ignores_keys() -> None:
    """Workers whose handlers declare no limit run today's claim, which never looks at keys."""
    rows = [Noop.enqueue(concurrency_key="free") for _ in range(2)]
    assert sorted(i.pk for i in claim(handlers=["noop"])) == [r.pk for r in rows]


def test_the_keyed_claim_takes_flow_locks_only_for_limited_keys() -> None:
    Noop.enqueue()
    Noop.enqueue(concurrency_key="unlimited")
    keyed_claim()
    if connection.vendor != "sqlite":
        assert not FlowLock.objects.exists()
    Keyed.enqueue({"key": "a"}, concurrency_key="A")
    keyed_claim()
    # MySQL locks FlowLock rows; PostgreSQL takes advisory locks instead.
    if connection.vendor == "mysql":
        assert list(FlowLock.objects.values_list("name", flat=True)) == ["key:keyed:A"]


def test_queue_filters_apply_to_the_keyed_claim() -> None:
    a = Keyed.enqueue({"key": "a"}, concurrency_key="A", queue="one")
    Keyed.enqueue({"key": "b"}, concurrency_key="B", queue="two")
    got = claim(handlers=HANDLERS, queues=["one"], limited=True)
    assert [i.pk for i in got] == [a.pk]
    Keyed.enqueue({"key": "c"}, concurrency_key="C", queue="three")
    got = claim(handlers=HANDLERS, queues=["two", "three"], limited=True)
    assert len(got) == 2


# -- slots belong to attempts ---------------------------------------------------------


def test_stale_recovery_frees_the_slot() -> None:
    from django_dbworker import transitions

    first = Keyed.enqueue({"key": "1"}, concurrency_key="A")
    second = Keyed.enqueue({"key": "2"}, concurrency_key="A")
    (held,) = keyed_claim()
    assert held.pk == first.pk
    assert keyed_claim() == []
    age_heartbeat(held, 3600)
    assert transitions.recover_stale(stale_after=60).requeued == 1
    # The recovered row is pending again; the key's slot is free: one of
    # its rows is claimed (recovery may have moved the row's run_after).
    (again,) = keyed_claim()
    assert again.pk in (first.pk, second.pk)
    assert claimed_keys() == [("keyed", "A")]


def test_a_late_fenced_success_frees_no_slot_held_by_the_new_attempt() -> None:
    from django_dbworker import transitions

    first = Keyed.enqueue({"key": "1"}, concurrency_key="A")
    (old,) = keyed_claim()
    age_heartbeat(old, 3600)
    transitions.recover_stale(stale_after=60)
    (new,) = keyed_claim()
    assert new.pk == first.pk and new.claim_token != old.claim_token
    Keyed.enqueue({"key": "2"}, concurrency_key="A")
    # The zombie's success is fenced out: it writes nothing...
    assert old.claim_token is not None
    assert operations().succeed_many([(old.pk, old.claim_token, None)]) == set()
    # ... so the new attempt still holds the key's only slot.
    assert keyed_claim() == []
    assert claimed_keys() == [("keyed", "A")]
    succeed(new)
    assert len(keyed_claim()) == 1


# -- the race for the last slot -------------------------------------------------------


def _claim_on_own_connection(
    barrier: threading.Barrier, worker: str, size: int, out: list[list[WorkItem]]
) -> None:
    try:
        connection.ensure_connection()  # connected first: the claims start together
        barrier.wait(10)
        # Each claimer locks rows of the key (SKIP LOCKED gives them different
        # ones), and each sees the key's slot free.
        out.append(keyed_claim(limit=size, worker=worker))
    finally:
        connections.close_all()


@pytest.mark.parametrize(
    ("limit_handler", "sizes"),
    [(Keyed, (1, 1, 1)), (KeyedPair, (1, 1, 1)), (KeyedPair, (1, 2, 3))],
    ids=["limit_1", "limit_2", "limit_2_claims_of_1_2_3"],
)
def test_concurrent_claimers_never_both_take_the_last_slot(
    limit_handler: type[WorkItemHandler], sizes: tuple[int, ...]
) -> None:
    """Claimers on their own connections race for a key's last free slot, many rounds:
    one row each, or claims of 1, 2 and 3 rows (more candidates of the key locked)."""
    limit = limit_handler.concurrency_limit
    assert limit is not None
    rounds, claimers = 40, len(sizes)
    for n in range(rounds):
        key = f"race:{n}"
        # Each claimer finds rows of the key ready and one slot free: the
        # other limit - 1 are held. The key was used before (its FlowLock
        # row exists: a new one would serialise the claimers by itself).
        for _ in range(limit):
            limit_handler.enqueue({"key": key}, concurrency_key=key)
        before = keyed_claim(limit=limit)
        assert len(before) == limit
        succeed(before[0])
        for _ in range(4):
            limit_handler.enqueue({"key": key}, concurrency_key=key)
        barrier = threading.Barrier(claimers)
        out: list[list[WorkItem]] = []
        threads = [
            threading.Thread(
                target=_claim_on_own_connection, args=(barrier, f"racer:{i}", size, out)
            )
            for i, size in enumerate(sizes)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(out) == claimers, "a claimer failed"
        claimed = WorkItem.objects.filter(
            status=Status.CLAIMED, concurrency_key=key, handler=limit_handler.name
        ).count()
        assert claimed == limit, f"round {n}: {claimed} claimed rows of a key limited to {limit}"
        assert sum(len(got) for got in out) == 1


# -- a worker ---------------------------------------------------------------------------


def test_a_worker_runs_keys_side_by_side_and_one_key_at_a_time(background_worker) -> None:
    from tests.conftest import wait_until
    from tests.factories import assert_no_key_overlaps

    keys, per_key = 6, 5
    for _ in range(per_key):
        for k in range(keys):
            Keyed.enqueue({"key": f"k{k}", "seconds": 0.02}, concurrency_key=f"k{k}")
    # A long poll interval: only the wake-up that each retired attempt
    # gives the claim loop (the ledger's, when its buffer runs low) makes
    # the next item of a key start soon after its slot is freed.
    worker = background_worker(["keyed"], concurrency=4, poll_interval=30.0)
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == keys * per_key,
        timeout=30,
        what="every keyed item to succeed",
    )
    assert assert_no_key_overlaps() > 1
    assert set(WorkItem.objects.values_list("attempts", flat=True)) == {1}
    assert worker is not None


def test_the_docs_example() -> None:
    """docs/topics/flow-control.md "Concurrency limits", with the suite's limit-1 handler."""
    first = Keyed.enqueue({"customer": 42}, concurrency_key="customer:42")
    second = Keyed.enqueue({"customer": 42}, concurrency_key="customer:42")
    other = Keyed.enqueue({"customer": 7}, concurrency_key="customer:7")
    batch = Keyed.enqueue_many([{"customer": 9}] * 3, concurrency_key="customer:9")
    assert (second.concurrency_key, second.concurrency_limit) == ("customer:42", 1)
    got = keyed_claim()
    assert sorted(i.pk for i in got) == sorted([first.pk, other.pk, batch[0].pk])
    assert WorkItem.objects.get(pk=second.pk).status == Status.PENDING


def test_dbworker_stats_lists_the_keys_at_their_limit() -> None:
    from io import StringIO

    from django.core.management import call_command

    from django_dbworker.stats import keys_at_limit

    for _ in range(2):
        Keyed.enqueue({"key": "a"}, concurrency_key="busy")
    KeyedPair.enqueue({"n": 1}, concurrency_key="half")  # 1 of 2 slots: not at its limit
    keyed_claim()
    assert keys_at_limit() == ([{"handler": "keyed", "key": "busy", "claimed": 1, "limit": 1}], 1)
    out = StringIO()
    call_command("dbworker_stats", stdout=out)
    assert "Concurrency keys at their limit" in out.getvalue()
    assert "busy" in out.getvalue()


# -- keys compare byte for byte, the current limit decides, slots and time --------


class KeyedTimeout(WorkItemHandler):
    """One item per key at once, abandoned after 0.5 s: records its start and end, then sleeps."""

    name = "keyed_timeout"
    concurrency_limit = 1
    timeout = 0.5
    max_attempts = 1

    def handle(self, payload: Any) -> None:
        _record(payload, "start")
        time.sleep(float(payload.get("seconds", 0)))
        _record(payload, "end")


def claimed_of(handler: str, key: str) -> list[int]:
    """Ids of the claimed rows of exactly (handler, key), compared in Python (byte for byte)."""
    rows = WorkItem.objects.filter(status=Status.CLAIMED, handler=handler).values_list(
        "pk", "concurrency_key"
    )
    return sorted(pk for pk, k in rows if k == key)


def lock_waiters() -> int:
    """Transactions waiting for a lock right now (MariaDB: on a FlowLock row too)."""
    return shared_lock_waiters("django_dbworker_flowlock")


# -- keys compare byte for byte ---------------------------------------------------


def test_keys_differing_only_in_case_accent_or_trailing_space_are_different_keys() -> None:
    """MariaDB: ``concurrency_key`` has the table's utf8mb4_unicode_ci (PAD SPACE) collation.

    README: "Names compare byte for byte" (the initial migration gives handler,
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
                got = keyed_claim(limit=2, worker="claimer:z")
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
            x_out.append(sorted(i.pk for i in keyed_claim(limit=10, worker="claimer:x")))
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
                out["z"] = [i.pk for i in keyed_claim(limit=1, worker="claimer:z")]
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
            out["x"] = [i.pk for i in keyed_claim(limit=5, worker="claimer:x")]
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


@pytest.mark.postgres_only
def test_the_keyed_claim_sets_read_committed_on_its_begin_not_by_a_statement() -> None:
    """PostgreSQL in autocommit: the claim's level rides on psycopg's BEGIN.

    A ``SET TRANSACTION ISOLATION LEVEL READ COMMITTED`` of its own was one
    round trip more per keyed claim (five where four do); the connection's
    own level is back afterwards.
    """
    import psycopg
    from django.test.utils import CaptureQueriesContext

    Keyed.enqueue({"key": "a"}, concurrency_key="A")
    connection.ensure_connection()
    connection.connection.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    try:
        with CaptureQueriesContext(connection) as ctx:
            assert len(keyed_claim()) == 1
        assert connection.connection.isolation_level == psycopg.IsolationLevel.REPEATABLE_READ
    finally:
        connection.connection.isolation_level = None
    sent = [q["sql"].split()[0] for q in ctx.captured_queries]
    assert "SET" not in sent, sent


# -- the limit on the row ---------------------------------------------------------


def test_a_deploy_that_drops_the_handlers_limit_runs_the_keys_rows_unlimited(
    background_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler's current declaration decides: rows stored with limit 1 run side by side.

    The row's ``concurrency_limit`` is the limit at enqueue, informational: the
    stored limit is not honoured (whatever the worker's other handlers).
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
    with pytest.raises(AssertionError):  # the runs of key "deploy" overlapped
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
@pytest.mark.xfail(
    strict=True, reason="documented (flow-control.md, Cost): a hot key's backlog is walked"
)
def test_a_claim_does_not_read_every_pending_row_of_a_key_at_its_limit() -> None:
    """The walk reads the whole backlog of a hot key at its limit, on every claim.

    The walk is the keyed claim of a worker that also serves an unlimited
    handler (``HANDLERS`` has ``noop``), and MySQL's and SQLite's; on
    PostgreSQL a worker of limited handlers only finds keys by index
    instead (test_keyed_claim_postgres.py).

    20,000 pending rows of one key (limit 1, one of them claimed), one row
    of another key behind them. The candidates' key filter runs per row in
    claim order (a probe of the slot index per row), so finding the one
    claimable row reads all 20,000: on PostgreSQL "Rows Removed by Filter:
    19999" and 20,000 SubPlan loops (about 56 ms per claim here, linear in
    the hot key's backlog: a million-row burst for one customer costs every
    poll of every worker seconds). The plain claim reads one row. A filter
    that probes a hashed list of the full keys per row instead of the slot
    index is cheaper per row: the same walk.
    """
    for _ in range(4):
        Keyed.enqueue_many([{"key": "hot"}] * 5000, concurrency_key="hot")
    assert len(keyed_claim(limit=1)) == 1  # the hot key is at its limit
    other = Keyed.enqueue({"key": "other"}, concurrency_key="other")
    if connection.vendor == "postgresql":
        import json

        from django_dbworker.db.postgresql_keyed_sql import candidates_statement

        with connection.cursor() as cursor:
            cursor.execute("ANALYZE django_dbworker_workitem")
        sql, params = candidates_statement(
            limit=4, handlers=HANDLERS, queues=None, limits={"keyed": 1, "keyed_pair": 2}
        )
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


@pytest.mark.xfail(
    strict=True,
    reason="documented (flow-control.md, Cost): a limited handler makes its worker's claims keyed",
)
def test_a_limited_handler_leaves_the_other_handlers_claims_to_the_plain_claim() -> None:
    """One ``concurrency_limit`` among a worker's handlers makes every claim of it keyed.

    On PostgreSQL four round trips and an advisory lock per key, where the
    plain claim is one UPDATE. Splitting the cycle (keyed claim, then plain)
    passed this and broke the claim order across the two
    (test_claim_order_with_limits.py); it was reverted. The calls are
    recorded on their way to the real claim.
    """
    from django_dbworker.worker import Worker
    from django_dbworker.worker.config import WorkerConfig

    Noop.enqueue_many([None] * 3)
    Keyed.enqueue({"key": "a"}, concurrency_key="A")
    worker = Worker([Noop, Keyed], WorkerConfig(inline=True, burst=True))
    calls: list[tuple[list[str], dict[str, int]]] = []
    real = worker.ops.claim

    def recording(**kwargs: Any) -> Any:
        calls.append((sorted(kwargs["handlers"]), dict(kwargs.get("limits") or {})))
        return real(**kwargs)

    worker.ops.claim = recording  # type: ignore[method-assign]
    try:
        worker.run()
    finally:
        del worker.ops.claim
    assert worker.outcomes == {"succeeded": 4}
    assert {tuple(handlers): limits for handlers, limits in calls} == {
        ("keyed",): {"keyed": 1},
        ("noop",): {},
    }


@pytest.mark.postgres_only
@pytest.mark.xfail(
    strict=True,
    reason="documented (flow-control.md, Cost): a limited handler means keyed claims",
)
def test_claims_of_unkeyed_rows_stay_one_statement_when_a_handler_declares_a_limit() -> None:
    """PostgreSQL: one concurrency_limit anywhere makes every claim four round trips.

    ``ClaimLoop`` runs the keyed claim whenever any handler the worker
    serves declares a limit (``run_workers`` serves every registered
    handler by default), also when no row has a key: BEGIN (at READ
    COMMITTED), the candidates, the claim, COMMIT, where the plain claim is
    one UPDATE ... RETURNING: the common path should not slow down.
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


def test_a_timed_out_attempt_frees_its_keys_slot_while_its_handler_runs(
    background_worker: Any,
) -> None:
    """Documented (flow-control.md): a limit holds while the worker owns the attempt.

    The first item of key T runs 3 s in a handler with ``timeout = 0.5``:
    at 0.5 s the attempt is recorded failed (its row is no longer claimed)
    while its abandoned thread keeps running user code, and the second item
    of T starts beside it. (The late outcome is fenced; the run itself is not.)
    """
    KeyedTimeout.enqueue({"key": "T", "seconds": 3}, concurrency_key="T")
    KeyedTimeout.enqueue({"key": "T", "seconds": 0}, concurrency_key="T")
    background_worker(["keyed_timeout"], concurrency=2)
    wait_until(
        lambda: Execution.objects.filter(key="T", kind="end").count() == 2,
        timeout=30,
        what="both runs of key T to end",
    )
    with pytest.raises(AssertionError):  # the second run started before the first ended
        assert_no_key_overlaps()
    first = WorkItem.objects.order_by("pk").first()
    assert first is not None and first.status == Status.FAILED
    assert "timeout" in first.last_error


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


# -- races, awkward keys, hot keys -------------------------------------------------


class KeyedThree(WorkItemHandler):
    """Three items per concurrency key at once; does nothing."""

    name = "keyed_three"
    concurrency_limit = 3

    def handle(self, payload: Any) -> None:
        return None


LIMITS = {"keyed": 1, "keyed_pair": 2, "keyed_three": 3}
HELD_HANDLERS = [*LIMITS, "noop"]


def over_limit() -> list[str]:
    """(handler, key) pairs with more claimed rows than their limit, keys compared exactly."""
    counts = Counter(
        WorkItem.objects.filter(status=Status.CLAIMED, handler__in=list(LIMITS)).values_list(
            "handler", "concurrency_key"
        )
    )
    return [f"{h} {k!r}: {n}" for (h, k), n in counts.items() if n > LIMITS[h]]


def test_many_claimers_and_finishers_never_exceed_a_keys_limit() -> None:
    """7 claimers on their own connections claim 1-6 rows at a time and finish some, 6 rounds.

    Each round uses new keys (their FlowLock rows are created by the racing
    claimers); the main thread checks the claimed rows per key all along.
    """
    seen: list[str] = []
    errors: list[str] = []
    for r in range(6):
        keys = [f"r{r}k{i}" for i in range(4)]
        for key in keys:
            for cls in (Keyed, KeyedPair, KeyedThree):
                cls.enqueue_many([{"key": key}] * 8, concurrency_key=key)
        barrier = threading.Barrier(7)

        def run(
            n: int, r: int = r, barrier: threading.Barrier = barrier, keys: list[str] = keys
        ) -> None:
            rnd = random.Random(n * 1000 + r)
            held: list[WorkItem] = []
            try:
                connection.ensure_connection()
                barrier.wait(10)
                deadline = time.monotonic() + 60
                rounds = 0
                # At least 30 claims, then on until the round's rows are all claimed (a
                # slow SQLite leg can leave a few of 576 pending after 30).
                while rounds < 30 or (
                    time.monotonic() < deadline
                    and WorkItem.objects.filter(
                        status=Status.PENDING, concurrency_key__in=keys
                    ).exists()
                ):
                    rounds += 1
                    got = claim(
                        limit=rnd.randint(1, 6),
                        handlers=HELD_HANDLERS,
                        worker=f"s:{n}",
                        limited=True,
                    )
                    held.extend(got)
                    rnd.shuffle(held)
                    k = rnd.randint(0, len(held))
                    done, held = held[:k], held[k:]
                    if done:
                        operations().succeed_many([(i.pk, i.claim_token, None) for i in done])
                if held:
                    operations().succeed_many([(i.pk, i.claim_token, None) for i in held])
            except Exception as exc:
                errors.append(repr(exc))
            finally:
                connections.close_all()

        threads = [threading.Thread(target=run, args=(n,)) for n in range(7)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            seen += over_limit()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert not seen, seen
    assert WorkItem.objects.filter(status=Status.SUCCEEDED).count() == 6 * 4 * 3 * 8


KEYS = ["a\tb\\c\nd\re", "\\N", "emoji😀x", "😀" * 200, "x" * 200, "naïve", "%s", "%(x)s", "'\""]


@pytest.mark.parametrize("count", [1, 3, 150])  # 150: PostgreSQL's COPY path
def test_awkward_keys_round_trip_and_are_counted_per_key(count: int) -> None:
    for key in KEYS:
        items = KeyedPair.enqueue_many([{"n": i} for i in range(count)], concurrency_key=key)
        stored = set(
            WorkItem.objects.filter(pk__in=[i.pk for i in items]).values_list(
                "concurrency_key", flat=True
            )
        )
        assert stored == {key}
        one = Keyed.enqueue({"key": key}, concurrency_key=key)
        assert WorkItem.objects.get(pk=one.pk).concurrency_key == key
    claim(limit=5000, handlers=HELD_HANDLERS, limited=True)
    assert not over_limit()
    per_key = Counter(
        WorkItem.objects.filter(status=Status.CLAIMED).values_list("handler", "concurrency_key")
    )
    assert per_key == {
        **{("keyed", k): 1 for k in KEYS},
        **{("keyed_pair", k): min(count, 2) for k in KEYS},
    }


@pytest.mark.parametrize("key", ["a\x00b", "\x00", "\ud800"])
def test_unstorable_keys_are_refused_writing_nothing(key: str) -> None:
    with pytest.raises(EnqueueError):
        Keyed.enqueue({"key": "x"}, concurrency_key=key)
    with pytest.raises(EnqueueError):
        Keyed.enqueue_many([{"key": "x"}] * 150, concurrency_key=key)
    assert not WorkItem.objects.exists()


# -- hot keys ---------------------------------------------------------------------


def test_a_hot_key_at_the_head_does_not_delay_other_keys_until_the_next_poll(
    background_worker: Any,
) -> None:
    """SQLite: a claim cut short by a hot key looks like an empty queue.

    40 rows of one key (limit 1) at the head of the claim order, 3 rows of
    other keys behind them, 4 free threads. A claim while the hot key's slot
    is free finds 4 candidates of the hot key and takes 1. PostgreSQL and
    MariaDB report the other 3 as throttled, so the claim loop claims again
    at once and finds the other keys; SQLite's statement reports nothing
    (``throttled`` is 0), the loop thinks it ran dry and sleeps a poll
    interval, and every retirement wake-up claims the hot key's next row
    only: the other keys wait for the poll interval (30 s here).
    """
    for n in range(40):
        Keyed.enqueue({"key": "hot", "seconds": 0.2, "n": n}, concurrency_key="hot")
    others = [Keyed.enqueue({"key": f"o{i}"}, concurrency_key=f"o{i}") for i in range(3)]
    background_worker(["keyed"], concurrency=4, poll_interval=30.0)
    wait_until(
        lambda: (
            WorkItem.objects.filter(pk__in=[o.pk for o in others], status=Status.SUCCEEDED).count()
            == 3
        ),
        timeout=8,
        what="the other keys' rows to succeed while the hot key runs",
    )
    assert Execution.objects.filter(key="hot", kind="end").count() < 40


# -- a paused best row ---------------------------------------------------------------------
# A key's slot goes to its best ready row, whichever worker serves it, also when the key's
# very best row waits in a paused queue.
#
# A worker of some queues leaves a limited key's row while a better row of the key waits in
# a queue it does not serve (SPEC "Flow control", docs "the best ready row of a key"): a
# key split across queues of different workers starved one of them. A row in a paused queue
# is claimed by no worker: it cannot take the slot, so the better rows behind it in other
# served queues must still be preferred. The rule only looks at the key's single best row,
# and a paused one switches it off for the whole key.


def test_a_paused_best_row_does_not_hand_the_keys_slot_to_a_worse_row() -> None:
    held = Keyed.enqueue({"key": "held"}, concurrency_key="K", queue="held", priority=10)
    theirs = Keyed.enqueue({"key": "theirs"}, concurrency_key="K", queue="theirs", priority=5)
    mine = Keyed.enqueue({"key": "mine"}, concurrency_key="K", queue="mine", priority=0)
    pause_queue("held")
    # The worker of "mine" alone: "theirs" (priority 5, ready, not paused) is the best row
    # any worker can take for K, and waits in a queue this worker does not serve.
    got = claim(limit=10, handlers=["keyed"], queues=["mine"], limited=True)
    assert [i.pk for i in got] == [], (
        f"the worker of 'mine' took K's slot for #{mine.pk} (priority 0) while #{theirs.pk} "
        f"(priority 5) waits in 'theirs'; #{held.pk} (priority 10) is paused"
    )
    # Without the paused row it does leave the key to "theirs" (the rule as it stands).
    WorkItem.objects.filter(pk=held.pk).delete()
    assert claim(limit=10, handlers=["keyed"], queues=["mine"], limited=True) == []


# -- the keyed cap counts keyed rows -------------------------------------------------------
# The keyed cap (KEYED_IN_FLIGHT rows per thread) counts rows of limited *keys*, not every
# row of a handler that declares a limit.
#
# A handler with a ``concurrency_limit`` limits only the rows enqueued with a
# ``concurrency_key``; its rows without one are "not limited" (SPEC "Flow control") and are
# prefetched like any unkeyed row (``worker/claim.py``). The cap on keyed rows must not count
# them: a buffer of such unkeyed rows would leave no room for any keyed row, and a keyed row
# of a higher priority would wait behind the whole unkeyed backlog of lower priority.


def test_a_keyed_row_is_claimed_beside_a_buffer_of_the_handlers_unkeyed_rows(
    background_worker: Callable[..., Worker],
) -> None:
    # 400 unkeyed rows of the limited handler, 50 ms each: 10 s of work for two threads,
    # prefetched for a horizon of 2 s (some 80 rows buffered).
    Keyed.enqueue_many([{"key": f"bulk-{n}", "seconds": 0.05} for n in range(400)])
    worker = background_worker(["keyed"], concurrency=2, poll_interval=0.2, prefetch_horizon=2.0)
    wait_until(
        lambda: Execution.objects.filter(kind="end").count() >= 6,
        what="the pace to be known: a buffer of unkeyed rows behind the running ones",
    )
    loop = worker.claim_loop
    assert loop is not None
    urgent = Keyed.enqueue({"key": "urgent", "seconds": 0}, concurrency_key="K", priority=10)
    # Its key is free and it outranks every buffered row: it starts within a refill or two.
    started = Execution.objects.filter(key="urgent", kind="start")
    deadline = time.monotonic() + 3
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists(), (
        f"the keyed priority-10 row (key free) is still "
        f"{WorkItem.objects.get(pk=urgent.pk).status} after 3 s, while "
        f"{Execution.objects.filter(kind='end').count()} unkeyed rows of priority 0 ran and "
        f"{loop.ledger.buffered()} are buffered"
    )
