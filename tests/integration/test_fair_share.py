"""Fair share between tenants: the key on every enqueue path, weights, bad input refused
with nothing written, and what operators see (``dbworker_stats``, the admin's filter).
The rotation itself runs in real workers: tests/process/test_fair_share.py."""

from __future__ import annotations

import math
from io import StringIO
from typing import Any, ClassVar

import pytest
from django.core.management import call_command

from django_dbworker import EnqueueError, WorkItemHandler, enqueue, enqueue_many, set_fair_weight
from django_dbworker.flow.models import FairKey
from django_dbworker.models import WorkItem
from tests.conftest import wait_until
from tests.testapp.workers import Noop

pytestmark = pytest.mark.django_db(transaction=True)


class Tenanted(WorkItemHandler):
    name = "tenanted_fair"
    fair_key: ClassVar[str | None] = "tenant:declared"

    def handle(self, payload: Any) -> None:
        return None


@pytest.mark.parametrize("count", [1, 150])  # 150: PostgreSQL's COPY path
def test_every_enqueue_path_carries_the_key_and_makes_its_rotation_row(count: int) -> None:
    Noop.enqueue_many([None] * count, fair_key="tenant:1")
    Noop.enqueue(None, fair_key="tenant:2")
    enqueue("noop", None, fair_key="tenant:3")
    enqueue_many("noop", [None], fair_key="tenant:4")
    Tenanted.enqueue(None)  # the handler's own key
    Tenanted.enqueue(None, fair_key="tenant:5")  # the enqueue's wins
    keys = WorkItem.objects.values_list("fair_key", flat=True)
    assert sorted(set(keys)) == [f"tenant:{n}" for n in (1, 2, 3, 4, 5)] + ["tenant:declared"]
    assert list(keys).count("tenant:1") == count
    assert sorted(FairKey.objects.values_list("key", flat=True)) == sorted(set(keys))


@pytest.mark.parametrize("key", [5, b"k", "", "x" * 201, ["k"], True, "a\x00b"])
def test_a_bad_fair_key_is_refused_writing_nothing(key: Any) -> None:
    with pytest.raises(EnqueueError, match="fair_key"):
        Noop.enqueue(None, fair_key=key)
    with pytest.raises(EnqueueError, match="fair_key"):
        Noop.enqueue_many([None, None], fair_key=key)
    with pytest.raises(EnqueueError, match="fair_key"):
        enqueue("noop", None, fair_key=key)
    with pytest.raises(ValueError, match="fair key"):
        set_fair_weight(key, 2)
    assert not WorkItem.objects.exists() and not FairKey.objects.exists()


@pytest.mark.parametrize("weight", [0, -1, "2", None, True, math.nan, math.inf, 1e7])
def test_a_bad_weight_is_refused_writing_nothing(weight: Any) -> None:
    with pytest.raises(ValueError, match="fair weight"):
        set_fair_weight("tenant:1", weight)
    assert not FairKey.objects.exists()


def test_weights_are_kept_per_key_and_shown_with_the_busiest_keys() -> None:
    set_fair_weight("big", 3)
    set_fair_weight("big", 2.5)  # changed, not added
    set_fair_weight(None, 0.5)  # the items without a key
    Noop.enqueue_many([None] * 3, fair_key="big")
    Noop.enqueue(None, fair_key="small")
    Noop.enqueue(None)
    assert dict(FairKey.objects.values_list("key", "weight")) == {
        "big": 2.5,
        "small": 1.0,
        "": 0.5,
    }
    out = StringIO()
    call_command("dbworker_stats", stdout=out)
    text = out.getvalue()
    section = text[text.index("Fair keys with the most ready work") :]
    lines = [line.split() for line in section.splitlines()[1:6]]
    assert ["big", "3", "2.5"] in lines and ["small", "1", "1"] in lines, section


def test_the_work_item_list_filters_by_fair_key(admin_client) -> None:
    Noop.enqueue_many([None] * 2, fair_key="tenant:a")
    other = Noop.enqueue(None, fair_key="tenant:b")
    plain = Noop.enqueue(None)
    url = "/admin/django_dbworker/workitem/"
    page = admin_client.get(url, {"fair_key": "tenant:b"}).content.decode()
    assert f"/{other.pk}/change/" in page and f"/{plain.pk}/change/" not in page
    page = admin_client.get(url, {"fair_key": "-"}).content.decode()
    assert f"/{plain.pk}/change/" in page and f"/{other.pk}/change/" not in page
    queues = admin_client.get("/admin/django_dbworker/queuestate/").content.decode()
    assert "dbw-fair-keys" in queues and "tenant:a" in queues
    # The Fair keys page edits weights, as set_fair_weight checks them.
    assert admin_client.get("/admin/django_dbworker/fairkey/").status_code == 200
    change = "/admin/django_dbworker/fairkey/tenant:a/change/"
    refused = admin_client.post(change, {"weight": "0"})
    assert refused.status_code == 200 and FairKey.objects.get(key="tenant:a").weight == 1.0
    assert admin_client.post(change, {"weight": "2.5"}).status_code == 302
    assert FairKey.objects.get(key="tenant:a").weight == 2.5
    # A key's row is not deleted while its items wait: without it they get no turns
    # (only what a flooding key's turns leave); once they ended, it may go.
    assert admin_client.post(change.replace("change", "delete"), {"post": "yes"}).status_code == 403
    selected = {"action": "delete_selected", "_selected_action": ["tenant:a"], "post": "yes"}
    admin_client.post("/admin/django_dbworker/fairkey/", selected)
    assert FairKey.objects.filter(key="tenant:a").exists()
    WorkItem.objects.filter(fair_key="tenant:a").update(status="succeeded")
    assert admin_client.post(change.replace("change", "delete"), {"post": "yes"}).status_code == 302
    assert not FairKey.objects.filter(key="tenant:a").exists()


@pytest.mark.parametrize("queues", [None, ["default"], ["default", "other"]])
@pytest.mark.parametrize("limited", [False, True])
def test_a_turn_claims_only_its_keys_rows_of_its_priority(
    queues: list[str] | None, limited: bool
) -> None:
    """Every claim statement (plain and keyed, any queue, one, several) narrowed to a turn."""
    from django_dbworker.db import operations
    from django_dbworker.db.sql import Turn
    from tests.testapp.workers import KeyedPair

    handler = KeyedPair if limited else Noop
    handler.enqueue_many([None] * 3, fair_key="a", concurrency_key="k" if limited else None)
    mine = handler.enqueue_many([None] * 3, fair_key="b", concurrency_key="k2" if limited else None)
    handler.enqueue_many([None] * 2, fair_key="b", priority=5)
    handler.enqueue_many([None] * 2)
    ops = operations("default")
    claimed = ops.claim(
        limit=10,
        handlers=[handler.name],
        queues=queues,
        worker="w",
        limits={handler.name: 2} if limited else None,
        turn=Turn("b", 0),
    )
    expected = [item.pk for item in mine][: 2 if limited else 3]
    assert [item.pk for item in claimed] == expected
    unkeyed = ops.claim(
        limit=10, handlers=[handler.name], queues=queues, worker="w", turn=Turn("", 0)
    )
    assert WorkItem.objects.filter(pk__in=[i.pk for i in unkeyed], fair_key=None).count() == 2
    assert len(unkeyed) == 2


def plain_take(ops: Any) -> Any:
    """The claim route's ``take`` for the plain claim of the handler ``noop``."""

    def take(rows: int, turns: Any) -> Any:
        if turns is None:
            return ops.claim(limit=rows, handlers=["noop"], queues=None, worker="w")
        return ops.claim_turns(turns=turns, handlers=["noop"], queues=None, worker="w")

    return take


def claims_of_one_row(rotation: Any, take: Any, claims: int) -> list[str | None]:
    """The keys of ``claims`` claims of one row each, in claim order."""
    keys: list[str | None] = []
    for _ in range(claims):
        got = rotation.claim(1, handlers=["noop"], queues=None, take=take)
        keys.extend(item.fair_key for item in got)
    return keys


def test_a_fair_claim_that_fails_midway_hands_over_the_rows_it_took() -> None:
    """A database error after some turns claimed rows: those rows are returned (to run),
    not left claimed by no one until stale recovery; with none taken, the error is raised."""
    from django.db import OperationalError

    from django_dbworker.db import operations
    from django_dbworker.db.sql import Turns
    from django_dbworker.flow.fair import FairRotation

    Noop.enqueue_many([None] * 3, fair_key="a")
    Noop.enqueue_many([None] * 3, fair_key="b")
    ops = operations("default")
    calls = []

    def take(rows: int, turns: Turns | None) -> Any:
        calls.append(turns)
        if len(calls) > 1:
            raise OperationalError("server closed the connection")
        assert turns is not None
        first = Turns(turns.priority, turns.shares[:1])  # the other key's rows were gone
        return ops.claim_turns(turns=first, handlers=["noop"], queues=None, worker="w")

    rotation = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
    got = rotation.claim(4, handlers=["noop"], queues=None, take=take)
    assert len(got) == 2 and {i.pk for i in got} == set(
        WorkItem.objects.filter(status="claimed").values_list("pk", flat=True)
    )
    calls.append(None)  # every take fails now
    with pytest.raises(OperationalError):
        rotation.claim(4, handlers=["noop"], queues=None, take=take)


def test_a_claim_of_turns_that_fails_midway_hands_over_the_rows_it_took(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same one level down, where turns are claimed one statement each (a keyed claim;
    every plain claim but PostgreSQL's): the turns before the failing one are returned."""
    from django.db import OperationalError

    from django_dbworker.db import operations
    from django_dbworker.db.sql import Turns

    Noop.enqueue_many([None] * 3, fair_key="a")
    Noop.enqueue_many([None] * 3, fair_key="b")
    ops = operations("default")
    claim = ops.claim
    calls = []

    def failing(**kwargs: Any) -> Any:
        calls.append(kwargs["turn"])
        if len(calls) > 1:
            raise OperationalError("server closed the connection")
        return claim(**kwargs)

    monkeypatch.setattr(ops, "claim", failing)
    turns = Turns(0, (("a", 2), ("b", 2)))
    got = ops.claim_turns(
        turns=turns, handlers=["noop"], queues=None, worker="w", limits={"noop": 5}
    )
    assert [i.fair_key for i in got] == ["a", "a"]
    assert {i.pk for i in got} == set(
        WorkItem.objects.filter(status="claimed").values_list("pk", flat=True)
    )
    calls.clear()
    calls.append(None)  # every claim fails now
    with pytest.raises(OperationalError):
        ops.claim_turns(turns=turns, handlers=["noop"], queues=None, worker="w", limits={"noop": 5})


def test_claims_after_a_stray_fair_key_finished_cost_one_read_more_than_plain() -> None:
    """A key enqueued once, its items gone, leaves its ``FairKey`` row: from then on a claim
    with no fair key's rows ready pays one read beside the plain claim, not the rotation's
    top-priority and per-key probes, a narrowed claim and an UPDATE of the rotation."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from django_dbworker.db import operations
    from django_dbworker.flow.fair import FairRotation

    ops = operations("default")

    take = plain_take(ops)

    Noop.enqueue_many([None] * 2)
    with CaptureQueriesContext(connection) as plain:
        assert len(take(2, None)) == 2
    Noop.enqueue(None, fair_key="stray")
    WorkItem.objects.filter(fair_key="stray").update(status="succeeded")
    assert FairKey.objects.filter(key="stray").exists()  # it stays
    waiting = [item.pk for item in Noop.enqueue_many([None] * 5)]
    rotation = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
    got: list[int] = []
    for _ in range(3):  # 2 + 2 + 1 rows, then none
        with CaptureQueriesContext(connection) as fair:
            got.extend(
                item.pk for item in rotation.claim(2, handlers=["noop"], queues=None, take=take)
            )
        assert len(fair.captured_queries) <= len(plain.captured_queries) + 1, [
            q["sql"] for q in fair.captured_queries
        ]
    assert got == waiting  # in the usual order
    assert list(FairKey.objects.values_list("key", flat=True)) == ["stray"]  # nothing written


@pytest.mark.postgres_only
def test_the_passes_count_every_claim_at_a_repeatable_read_default() -> None:
    """A server (or role) whose default_transaction_isolation is REPEATABLE READ: a
    claim's pass UPDATE that waited on another claimer's lock of the key's row, which then
    committed, would fail with a serialization failure; the claim's rows ran, but its key's
    pass forgot them (the key's turns came again, ahead of the others)."""
    import threading

    from django.db import connection, connections, transaction
    from django.db.models import F

    from django_dbworker.db import operations
    from django_dbworker.flow.fair import FairRotation
    from tests.conftest import wait_until

    Noop.enqueue_many([None] * 2, fair_key="a")
    out: dict[str, Any] = {}

    def claimer() -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SET default_transaction_isolation = 'repeatable read'")
            ops = operations("default")

            take = plain_take(ops)

            rotation = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
            out["rows"] = len(rotation.claim(1, handlers=["noop"], queues=None, take=take))
        except BaseException as exc:  # pragma: no cover - reported below
            out["error"] = exc
        finally:
            connections.close_all()

    with transaction.atomic():  # another claimer's pass UPDATE, not yet committed
        FairKey.objects.filter(key="a").update(served=F("served") + 5)
        thread = threading.Thread(target=claimer)
        thread.start()

        def waiting() -> bool:
            with connection.cursor() as cursor:
                cursor.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")
                return cursor.fetchone()[0] > 0

        wait_until(waiting, what="the claim's pass UPDATE waiting on the key's row")
    thread.join(30)
    assert out.get("rows") == 1, out
    assert FairKey.objects.get(key="a").served == 6.0  # the other claimer's 5, and this 1


def test_a_handlers_bad_fair_key_is_a_check_error() -> None:
    """Declared on the class, a bad key would refuse every enqueue: the checks say so first."""
    from django_dbworker.checks import fair_key_errors
    from django_dbworker.registry import registry

    for n, key in enumerate(["", 5, "a\x00b", "x" * 201]):

        class Bad(WorkItemHandler):
            name = f"bad_fair_{n}"
            fair_key = key

        try:
            errors = fair_key_errors([Bad, Tenanted, Noop])
            assert [e.id for e in errors] == ["django_dbworker.E024"], key
            assert f"bad_fair_{n}" in errors[0].msg and "fair_key" in errors[0].msg
            with pytest.raises(EnqueueError, match="fair_key"):
                Bad.enqueue(None)
        finally:
            registry.unregister(f"bad_fair_{n}")
    assert not WorkItem.objects.exists()


def test_while_keys_take_turns_a_worker_buffers_a_short_horizon(background_worker: Any) -> None:
    """A key's new item is dealt its turn in the next claim and waits behind what is buffered
    then: while fair keys take turns, a worker buffers ``FAIR_HORIZON`` of work, not
    ``PREFETCH_HORIZON``: about ten times as many claims of the same jobs as without keys."""
    from tests.testapp.workers import Pace

    claims = {}
    for fair_key in (None, "a"):
        Pace.enqueue_many([{"seconds": 0.004}] * 300, fair_key=fair_key)
        worker = background_worker(["pace"], concurrency=2, burst=True, prefetch_horizon=0.5)
        wait_until(
            lambda: not WorkItem.objects.exclude(status="succeeded").exists(),
            timeout=60,
            what="300 paced items",
        )
        claims[fair_key] = worker.claims
    # 2 threads of 4 ms jobs start up to 500 a second: up to 250 rows buffered at 0.5 s,
    # 25 at FAIR_HORIZON (claims refill at half the buffer). Seen: 4-5 claims against 32-62.
    assert claims["a"] >= 3 * claims[None], claims


def test_claims_of_one_row_take_turns_when_rows_without_a_key_wait() -> None:
    """Claims of one row (one thread of long jobs; a claim's last round) while rows without
    a key are ready: the keys still take turns. The keys read was cut to one key by pass,
    which the rows without a key (first on ties) filled alone: "no key's turn" then sent
    every such claim to the usual order, which never advanced their pass."""
    from django_dbworker.db import operations
    from django_dbworker.flow.fair import FairRotation

    Noop.enqueue_many([None] * 10, fair_key="flood")
    Noop.enqueue(None, fair_key="small")
    Noop.enqueue_many([None] * 2)  # rows without a key
    take = plain_take(operations("default"))
    rotation = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
    keys = claims_of_one_row(rotation, take, 4)
    # Three keys with work (flood, small, no key), weights 1: each within the first 4.
    assert "small" in keys and None in keys, keys


@pytest.mark.parametrize("odd", ["%s", "%(x)s", "{x}", "'", "a,b", "NULL", "é" * 200])
def test_keys_of_any_characters_take_their_turns(odd: str) -> None:
    """Keys that quoting, array literals or %-formatting could mangle are claimed as keys."""
    from django_dbworker.db import operations
    from django_dbworker.flow.fair import FairRotation

    Noop.enqueue_many([None] * 4, fair_key="flood")
    mine = Noop.enqueue_many([None] * 2, fair_key=odd)
    take = plain_take(operations("default"))
    rotation = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
    got = rotation.claim(4, handlers=["noop"], queues=None, take=take)
    assert sorted(i.fair_key for i in got) == sorted(["flood", "flood", odd, odd])
    assert {i.pk for i in got} >= {i.pk for i in mine}
    assert FairKey.objects.get(key=odd).served == 2.0


@pytest.mark.server_db
def test_two_claimers_of_turns_at_once_take_every_row_once() -> None:
    """Two rotations (two workers) claim turns at once on their own connections, over keys,
    rows without a key and two priorities: every row claimed, none twice."""
    import threading

    from django.db import connections

    from django_dbworker.db import operations
    from django_dbworker.flow.fair import FairRotation

    for key in ("a", "b", "c", None):
        Noop.enqueue_many([None] * 60, fair_key=key)
    Noop.enqueue_many([None] * 10, fair_key="b", priority=3)
    got: list[list[int]] = [[], []]
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run(n: int) -> None:
        try:
            take = plain_take(operations("default"))
            rotation = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
            barrier.wait()
            while taken := rotation.claim(3, handlers=["noop"], queues=None, take=take):
                got[n].extend(i.pk for i in taken)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    both = got[0] + got[1]
    assert len(both) == len(set(both)) == 250
    assert set(both) == set(WorkItem.objects.values_list("pk", flat=True))


def _flood(key: str | None, n: int) -> None:
    """``n`` ready rows of ``key`` (PostgreSQL: one INSERT ... SELECT from a first row)."""
    from django.db import connection

    Noop.enqueue(None, fair_key=key)
    table = WorkItem._meta.db_table
    columns = ", ".join(f.column for f in WorkItem._meta.concrete_fields if not f.primary_key)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} ({columns}) SELECT {columns} FROM {table} "
            "CROSS JOIN generate_series(1, %s) WHERE fair_key IS NOT DISTINCT FROM %s",
            [n - 1, key],
        )


@pytest.mark.postgres_only
@pytest.mark.parametrize("statistics", ["analyzed", "no-row", "no-row-of-a-first-backlog"])
@pytest.mark.parametrize("queues", [None, ["default", "other"]], ids=["any-queue", "queues"])
def test_the_fair_claim_reads_each_turns_rows_only(
    statistics: str, queues: list[str] | None
) -> None:
    """Every turn's rows by dbworker_fair_idx from the key's first ready row, the rows
    without a key too, and the claimed rows by their ids: not the other keys' rows ahead in
    claim order, nor the whole table, whether the statistics know the backlog or, analyzed
    while it was uncommitted, say the table holds no row (test_claim_plans)."""
    import psycopg
    from django.db import connection, transaction

    from django_dbworker.db import operations
    from django_dbworker.db.sql import Turns
    from tests.factories import auto_explained_json, rows_read

    table = WorkItem._meta.db_table
    with connection.cursor() as cursor:
        if statistics == "no-row-of-a-first-backlog":  # no column statistics either
            cursor.execute(f"DELETE FROM pg_statistic WHERE starelid = '{table}'::regclass")
        else:
            _flood("x", 1000)  # an earlier backlog's
            cursor.execute(f"ANALYZE {table}")
            cursor.execute(f"TRUNCATE {table}")
    with transaction.atomic():
        _flood(None, 20000)
        _flood("a", 20000)
        _flood("b", 5)
        if statistics != "analyzed":
            with psycopg.connect(**connection.get_connection_params(), autocommit=True) as other:
                other.execute(f"ANALYZE {table}")
    if statistics == "analyzed":
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {table}")
    turns = Turns(0, (("a", 2), ("", 2), ("b", 2)))
    got, plans = auto_explained_json(
        lambda: operations("default").claim_turns(
            turns=turns, handlers=["noop"], queues=queues, worker="w"
        )
    )
    assert sorted(i.fair_key or "" for i in got) == ["", "", "a", "a", "b", "b"]
    plan = [p for p in plans if "Update" in str(p)][-1]
    assert rows_read(plan["Plan"]) < 200, plan


def test_turns_go_priority_by_priority_past_a_priority_without_keys() -> None:
    """The top priority holds only rows without a key: those are claimed, and the rest of
    the claim is dealt in turns at the next priority, not taken in the usual order (which
    gives a flooding key every row it has before another key's)."""
    from django_dbworker.db import operations
    from django_dbworker.flow.fair import FairRotation

    Noop.enqueue_many([None] * 2, priority=5)  # rows without a key, first
    Noop.enqueue_many([None] * 10, fair_key="flood")
    Noop.enqueue(None, fair_key="small")
    rotation = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
    got = rotation.claim(4, handlers=["noop"], queues=None, take=plain_take(operations("default")))
    assert [(i.priority, i.fair_key) for i in got][:2] == [(5, None), (5, None)]
    assert sorted(i.fair_key for i in got[2:]) == ["flood", "small"]


def test_weights_hold_over_many_claims_of_one_row_and_of_mixed_sizes() -> None:
    from django_dbworker.db import operations
    from django_dbworker.flow.fair import FairRotation

    set_fair_weight("big", 3)
    Noop.enqueue_many([None] * 60, fair_key="big")
    Noop.enqueue_many([None] * 60, fair_key="small")
    take = plain_take(operations("default"))
    rotation = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
    got: list[Any] = []
    for size in [1, 2, 3, 5, 1, 7, 1, 4, 8, 1, 1, 6] * 2:
        claimed = rotation.claim(size, handlers=["noop"], queues=None, take=take)
        got.extend(item.fair_key for item in claimed)
    assert abs(got.count("big") - 3 * len(got) / 4) <= 3, (len(got), got.count("big"))


@pytest.mark.parametrize("workers", [2, 4])
def test_workers_dealing_from_the_same_passes_keep_the_weights(workers: int) -> None:
    """Several workers whose claims read the passes at the same moment (each deals from
    what it read, then claims and advances): over many claims of one row the starts still
    divide 3:1. Each claim's turn began at the pass as the UPDATE found it, with the other
    workers' increments: the clock ran ahead of the waiting key, which then started from
    it, its credit lost (0.67 of the starts to the heavy key with 2 workers, 0.5 with 4).

    The interleaving is made certain: each worker's claim runs the next one's whole claim
    between its own read of the passes and its take."""
    from collections import Counter

    from django_dbworker.db import operations
    from django_dbworker.flow.fair import FairRotation

    set_fair_weight("big", 3)
    Noop.enqueue_many([None] * 300, fair_key="big")
    Noop.enqueue_many([None] * 300, fair_key="small")
    plain = plain_take(operations("default"))
    rotations = [
        FairRotation(using="default", every=1.0, clock=lambda: 0.0) for _ in range(workers)
    ]
    got: list[Any] = []

    def claim(n: int) -> None:
        def take(rows: int, turns: Any) -> Any:
            if n + 1 < workers and turns is not None:
                claim(n + 1)  # the next worker read the same passes, and claims first
            return plain(rows, turns)

        claimed = rotations[n].claim(1, handlers=["noop"], queues=None, take=take)
        got.extend(item.fair_key for item in claimed)

    while len(got) < 200:
        claim(0)
    share = Counter(got[:200])["big"] / 200
    assert share == pytest.approx(0.75, abs=0.04), (
        share,
        list(FairKey.objects.values_list("key", "served", "started")),
    )


@pytest.mark.parametrize("split", ["handlers", "queues"])
def test_a_key_that_other_workers_serve_alone_leaves_these_keys_their_turns(split: str) -> None:
    """Worker 2 claims for its own handlers (or ``--queue``) and serves key "solo" alone;
    worker 1 deals keys a and b (weights 1, both with a backlog): its claims alternate
    them. (The clock was every key's highest pass at a turn's start: "solo" ran it ahead,
    a and b both started from it every claim, and the tie went to a.)"""
    from django_dbworker.db import operations
    from django_dbworker.flow.fair import FairRotation
    from tests.testapp.workers import Echo

    ops = operations("default")
    if split == "handlers":
        Noop.enqueue_many([None] * 40, fair_key="a")
        Noop.enqueue_many([None] * 40, fair_key="b")
        Echo.enqueue_many([None] * 200, fair_key="solo")
        one, two = (["noop"], None), (["echo"], None)
    else:
        Noop.enqueue_many([None] * 40, fair_key="a", queue="q1")
        Noop.enqueue_many([None] * 40, fair_key="b", queue="q1")
        Noop.enqueue_many([None] * 200, fair_key="solo", queue="q2")
        one, two = (["noop"], ["q1"]), (["noop"], ["q2"])

    def take_of(handlers: list[str], queues: list[str] | None) -> Any:
        def take(rows: int, turns: Any) -> Any:
            if turns is None:
                return ops.claim(limit=rows, handlers=handlers, queues=queues, worker="w")
            return ops.claim_turns(turns=turns, handlers=handlers, queues=queues, worker="w")

        return take

    first = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
    second = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
    keys: list[Any] = []
    for _ in range(20):
        got = first.claim(1, handlers=one[0], queues=one[1], take=take_of(*one))
        keys.extend(item.fair_key for item in got)
        second.claim(4, handlers=two[0], queues=two[1], take=take_of(*two))
    assert keys.count("b") >= 8, (keys, list(FairKey.objects.values_list("key", "served")))


def test_a_key_ahead_of_new_keys_beyond_the_read_is_not_held_back() -> None:
    """Key "old" has been served alone (its pass is 30) and still has a backlog; four new
    tenants arrive with backlogs of their own (passes 0): "old" takes about one turn in
    five. (When the clock came from the keys a claim of one row read, the four of lowest
    pass, the new keys were not lifted to the rotation's pass, and "old" waited for each
    of them to run 30 rows.)"""
    from django_dbworker.db import operations
    from django_dbworker.flow.fair import FairRotation

    take = plain_take(operations("default"))
    rotation = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
    Noop.enqueue_many([None] * 60, fair_key="old")
    for _ in range(30):  # "old" alone: its pass runs to 30
        rotation.claim(1, handlers=["noop"], queues=None, take=take)
    for n in range(4):
        Noop.enqueue_many([None] * 60, fair_key=f"new{n}")
    keys = claims_of_one_row(rotation, take, 20)
    # Five keys with backlogs, weights 1: "old" about one start in five.
    passes = list(FairKey.objects.values_list("key", "served", "started"))
    assert keys.count("old") >= 3, (keys, passes)


def test_keys_back_from_idling_beyond_the_read_do_not_take_the_turns_they_missed() -> None:
    """Four keys served a little, then idle while "busy" runs 40 rows alone; they come
    back together, and start level with "busy", which keeps its turns. (When the clock came
    from the keys read, the four of lowest pass, nothing lifted them: they took the ~40
    turns each they had missed while "busy", with a backlog, waited.)"""
    from django_dbworker.db import operations
    from django_dbworker.flow.fair import FairRotation

    take = plain_take(operations("default"))
    rotation = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
    for n in range(4):
        Noop.enqueue(None, fair_key=f"idle{n}")
    Noop.enqueue_many([None] * 100, fair_key="busy")
    for _ in range(44):  # the idle keys' one row each, then "busy" alone
        rotation.claim(1, handlers=["noop"], queues=None, take=take)
    for n in range(4):
        Noop.enqueue_many([None] * 60, fair_key=f"idle{n}")  # back
    keys = claims_of_one_row(rotation, take, 20)
    passes = list(FairKey.objects.values_list("key", "served", "started"))
    assert keys.count("busy") >= 3, (keys, passes)


def test_a_key_back_after_another_workers_large_claim_starts_level_with_the_active_keys() -> None:
    """Worker 2 claims 32 rows: keys a and b (backlogs) take 16 each. Key c comes back:
    worker 1's claims of one row alternate the three. (``started`` was the pass a turn
    began at, 0 for a and b: c started 16 behind them and took 16 turns in a row, the rows
    a and b had while it was idle; it is now the pass of a turn's last row.)"""
    from django_dbworker.db import operations
    from django_dbworker.flow.fair import FairRotation

    take = plain_take(operations("default"))
    first = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
    second = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
    Noop.enqueue_many([None] * 100, fair_key="a")
    Noop.enqueue_many([None] * 100, fair_key="b")
    assert len(second.claim(32, handlers=["noop"], queues=None, take=take)) == 32
    Noop.enqueue_many([None] * 100, fair_key="c")
    keys = claims_of_one_row(first, take, 9)
    passes = list(FairKey.objects.values_list("key", "served", "started"))
    # Three keys with backlogs, weights 1: about three starts each.
    assert keys.count("c") <= 5, (keys, passes)


def test_rows_without_a_key_keep_their_turns_after_a_priority_of_their_own() -> None:
    """30 rows without a key at priority 5 are claimed first (the row "" alone: its pass
    runs to 30). At priority 0 wait more rows without a key and four new keys' backlogs:
    the rows without a key keep about one turn in five. (When the clock came from the keys
    read, the four of lowest pass, they got none until each key had run ~30 rows.)"""
    from django_dbworker.db import operations
    from django_dbworker.flow.fair import FairRotation

    take = plain_take(operations("default"))
    rotation = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
    Noop.enqueue(None, fair_key="seen")  # a FairKey row: the rotation is in use
    WorkItem.objects.filter(fair_key="seen").update(status="succeeded")
    Noop.enqueue_many([None] * 30, priority=5)
    Noop.enqueue_many([None] * 60)
    for n in range(4):
        Noop.enqueue_many([None] * 60, fair_key=f"k{n}")
    for _ in range(30):
        got = rotation.claim(1, handlers=["noop"], queues=None, take=take)
        assert [(i.priority, i.fair_key) for i in got] == [(5, None)]
    keys = claims_of_one_row(rotation, take, 20)
    passes = list(FairKey.objects.values_list("key", "served", "started"))
    assert keys.count(None) >= 3, (keys, passes)


def test_keys_keep_their_turns_while_the_top_prioritys_key_is_held_by_its_limit() -> None:
    """Key p's rows wait at priority 5, but their concurrency key is at its limit (two
    running): its turn takes nothing. Below, at priority 0, "flood" (enqueued first, a
    backlog) and "small" take turns. (The claim fell back to the usual order: "flood" took
    every row, "small" none, as long as p was held.)"""
    from django_dbworker.db import operations
    from django_dbworker.flow.fair import FairRotation
    from tests.testapp.workers import KeyedPair

    ops = operations("default")
    KeyedPair.enqueue_many([None] * 4, fair_key="p", concurrency_key="k", priority=5)
    held = ops.claim(
        limit=2, handlers=["keyed_pair"], queues=None, worker="other", limits={"keyed_pair": 2}
    )
    assert len(held) == 2
    Noop.enqueue_many([None] * 50, fair_key="flood")
    Noop.enqueue_many([None] * 5, fair_key="small")
    handlers = ["keyed_pair", "noop"]

    def take(rows: int, turns: Any) -> Any:
        common: dict[str, Any] = {"handlers": handlers, "queues": None, "worker": "w"}
        limits = {"keyed_pair": 2}
        if turns is None:
            return ops.claim(limit=rows, limits=limits, **common)
        return ops.claim_turns(turns=turns, limits=limits, **common)

    rotation = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
    keys: list[Any] = []
    for _ in range(10):
        got = rotation.claim(1, handlers=handlers, queues=None, take=take)
        keys.extend(item.fair_key for item in got)
    passes = list(FairKey.objects.values_list("key", "served", "started"))
    assert keys.count("small") >= 3, (keys, passes)


def test_weights_hold_while_another_worker_serves_a_shared_key_on_its_own_handler() -> None:
    """Worker 1 serves ``noop``: keys a (weight 3) and b (weight 1) with backlogs, and key
    x, which also has ``noop`` rows. Worker 2 serves ``echo`` alone, where only x has rows:
    it runs x's pass ahead. a and b still divide 3:1. (Every claim lifted a and b, behind
    the clock that x's turns ran ahead, and they alternated 1:1.)"""
    from django_dbworker.db import operations
    from django_dbworker.flow.fair import FairRotation
    from tests.testapp.workers import Echo

    ops = operations("default")
    set_fair_weight("a", 3)
    Noop.enqueue_many([None] * 100, fair_key="a")
    Noop.enqueue_many([None] * 100, fair_key="b")
    Noop.enqueue_many([None] * 100, fair_key="x")
    Echo.enqueue_many([None] * 300, fair_key="x")

    def take_of(handlers: list[str]) -> Any:
        def take(rows: int, turns: Any) -> Any:
            if turns is None:
                return ops.claim(limit=rows, handlers=handlers, queues=None, worker="w")
            return ops.claim_turns(turns=turns, handlers=handlers, queues=None, worker="w")

        return take

    first = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
    second = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
    keys: list[Any] = []
    for _ in range(40):
        got = first.claim(1, handlers=["noop"], queues=None, take=take_of(["noop"]))
        keys.extend(item.fair_key for item in got)
        second.claim(2, handlers=["echo"], queues=None, take=take_of(["echo"]))
    a, b = keys.count("a"), keys.count("b")
    passes = list(FairKey.objects.values_list("key", "served", "started", "weight"))
    assert a >= 2.5 * b, (a, b, keys, passes)


def test_weights_hold_while_a_key_with_urgent_rows_runs_the_clock_ahead() -> None:
    """One worker. Keys b (weight 3) and c (weight 1) have backlogs at priority 0; key a
    has one there too, and urgent rows (priority 5) before every other claim. b and c still
    divide 3:1. (a's urgent turns ran the clock ahead, every claim lifted b and c to it, and
    they alternated 1:1.)"""
    from django_dbworker.db import operations
    from django_dbworker.flow.fair import FairRotation

    set_fair_weight("b", 3)
    Noop.enqueue_many([None] * 100, fair_key="a")
    Noop.enqueue_many([None] * 100, fair_key="b")
    Noop.enqueue_many([None] * 100, fair_key="c")
    take = plain_take(operations("default"))
    rotation = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
    bulk: list[Any] = []
    for _ in range(40):
        Noop.enqueue_many([None] * 2, fair_key="a", priority=5)
        urgent = rotation.claim(2, handlers=["noop"], queues=None, take=take)
        assert [(i.priority, i.fair_key) for i in urgent] == [(5, "a"), (5, "a")]
        got = rotation.claim(1, handlers=["noop"], queues=None, take=take)
        bulk.extend(item.fair_key for item in got)
    b, c = bulk.count("b"), bulk.count("c")
    passes = list(FairKey.objects.values_list("key", "served", "started", "weight"))
    assert b >= 2.5 * c, (b, c, bulk, passes)


def test_a_key_back_after_two_workers_large_claims_from_the_same_passes_starts_level() -> None:
    """Workers 1 and 2 read the passes at the same moment (a and b at 0, backlogs) and each
    claims 16 rows: a and b reach pass 16. Key c comes back level with them. (Each worker
    set ``started`` to the pass of the last row as it dealt it, 7: c started nine rows
    behind the keys it joined and took about nine turns in a row.)"""
    from django_dbworker.db import operations
    from django_dbworker.flow.fair import FairRotation

    plain = plain_take(operations("default"))
    first = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
    second = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
    third = FairRotation(using="default", every=1.0, clock=lambda: 0.0)
    Noop.enqueue_many([None] * 100, fair_key="a")
    Noop.enqueue_many([None] * 100, fair_key="b")

    def take(rows: int, turns: Any) -> Any:
        if turns is not None:  # worker 2 read the same passes, and claims first
            assert len(second.claim(16, handlers=["noop"], queues=None, take=plain)) == 16
        return plain(rows, turns)

    assert len(first.claim(16, handlers=["noop"], queues=None, take=take)) == 16
    Noop.enqueue_many([None] * 100, fair_key="c")
    keys = claims_of_one_row(third, plain, 9)
    passes = list(FairKey.objects.values_list("key", "served", "started"))
    # Three keys with backlogs, weights 1: about three starts each.
    assert keys.count("c") <= 5, (keys, passes)
