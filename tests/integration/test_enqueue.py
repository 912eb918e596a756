"""Enqueue: validation, transactions, unique work, bulk insert."""

from __future__ import annotations

import datetime as dt
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection, transaction
from django.db.models.functions import Now
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_dbworker import EnqueueError, enqueue, enqueue_many
from django_dbworker.models import Status, WorkItem
from tests.testapp.workers import Echo, Flaky, InvoiceMailer, Noop

pytestmark = pytest.mark.django_db


def test_enqueue_fills_defaults_from_the_handler() -> None:
    item = Echo.enqueue({"a": 1})
    row = WorkItem.objects.get(pk=item.pk)
    assert (row.handler, row.queue, row.payload, row.status) == (
        "echo",
        "echoes",
        {"a": 1},
        "pending",
    )
    assert row.max_attempts == 3 and Flaky.enqueue({}).max_attempts == 4
    assert row.attempts == 0 and row.priority == 0
    assert item.run_after == row.run_after  # loaded from the DB default on access
    assert (item.created_at, item.updated_at) == (row.created_at, row.updated_at)
    assert WorkItem.objects.ready().filter(pk=item.pk).exists()


def test_enqueue_by_name_and_options() -> None:
    item = enqueue("noop", [1, 2], priority=-100, queue="other.q:1")
    assert (item.handler, item.priority, item.queue, item.payload) == (
        "noop",
        -100,
        "other.q:1",
        [1, 2],
    )


def test_run_after_timedelta_is_relative_to_the_database_clock() -> None:
    item = Noop.enqueue(None, run_after=timedelta(hours=1))
    assert WorkItem.objects.filter(pk=item.pk, run_after__gt=Now() + timedelta(minutes=59)).exists()
    assert not WorkItem.objects.ready().exists()


def test_run_after_datetime_is_stored_as_given() -> None:
    when = dt.datetime(2031, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    item = Noop.enqueue(None, run_after=when)
    assert WorkItem.objects.get(pk=item.pk).run_after == when


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"handler": "nope"}, "Unknown handler 'nope'. Registered handlers: "),
        ({"handler": "invoice-mailer"}, "not a WorkItemHandler"),
        ({"payload": {"d": Decimal("1.5")}}, "not JSON-serialisable"),
        ({"payload": {"x": float("nan")}}, "not JSON-serialisable"),
        ({"payload": object()}, "not JSON-serialisable"),
        ({"priority": 101}, "out of range -100..100"),
        ({"priority": -101}, "out of range -100..100"),
        ({"priority": 1.5}, "must be an integer"),
        ({"priority": True}, "must be an integer"),
        ({"queue": "has space"}, "Queue name 'has space' is invalid"),
        ({"queue": ""}, "is invalid"),
        ({"queue": "q" * 101}, "is invalid"),
        ({"run_after": "tomorrow"}, "run_after must be a datetime or a timedelta"),
        ({"run_after": dt.datetime(2030, 1, 1)}, "naive datetime"),
        ({"unique_key": ""}, "unique_key must be a string of 1 to 255"),
        ({"unique_key": 5}, "unique_key must be a string"),
    ],
)
def test_bad_input_raises_enqueue_error_and_writes_nothing(kwargs: dict, message: str) -> None:
    handler = kwargs.pop("handler", "noop")
    payload = kwargs.pop("payload", {"ok": 1})
    with pytest.raises(EnqueueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        enqueue(handler, payload, **kwargs)
    assert not WorkItem.objects.exists()


NUL_PAYLOADS = [
    "secret-marker\x00",
    {"note": "secret-marker \x00 in a value"},
    {"secret-marker\x00": "in a key"},
    {"a": [1, {"b": ["fine", ("secret-marker", {"c": "nested \x00"})]}]},
    [{"k": 1}, {"secret-marker": {"deep\x00": None}}],
    {"C:\\u0000": "\\u0000", "z": "secret-marker\\\x00"},  # literal escapes, then a NUL
]


@pytest.mark.parametrize("payload", NUL_PAYLOADS)
def test_a_nul_character_in_a_payload_is_refused_without_quoting_it(payload: object) -> None:
    # PostgreSQL's jsonb cannot hold \u0000; SQLite could. Refused on both,
    # so a SQLite dev setup fails the same way as PostgreSQL production.
    with pytest.raises(EnqueueError, match="NUL character") as enqueued:
        Echo.enqueue(payload)
    with pytest.raises(EnqueueError, match=r"^Payload #1: .*NUL character") as many:
        Echo.enqueue_many([{"ok": 1}, payload, {"ok": 2}])
    for exc in (enqueued.value, many.value):
        assert "secret-marker" not in str(exc)
    assert not WorkItem.objects.exists()


def test_a_backslash_before_u0000_is_not_a_nul() -> None:
    text = "C:\\u0000\\path"  # a literal backslash, then "u0000": JSON "\\u0000"
    item = Echo.enqueue({text: text})
    (many,) = Echo.enqueue_many([[text]])
    assert WorkItem.objects.get(pk=item.pk).payload == {text: text}
    assert WorkItem.objects.get(pk=many.pk).payload == [text]


NON_STR_KEY_PAYLOADS = [
    ({1: "a"}, "payload[1] (an int)"),
    ({"a": [{"b": {2.5: 1}}]}, "payload['a'][0]['b'][2.5] (a float)"),
    ([{"x": 1}, ({"y": {None: 4}},)], "payload[1][0]['y'][None] (None)"),
    ({"ok": {"1": 1}, "k": {False: 0}}, "payload['k'][False] (a bool)"),
]


@pytest.mark.parametrize(("payload", "where"), NON_STR_KEY_PAYLOADS)
def test_a_dict_key_that_is_not_a_string_is_refused_naming_its_path(
    payload: object, where: str
) -> None:
    # JSON object keys are strings: {1: "a"} would arrive as {"1": "a"},
    # and a handler's payload[1] would raise KeyError at run time.
    with pytest.raises(EnqueueError, match="dict key that is not a string") as enqueued:
        Echo.enqueue(payload)
    assert where in str(enqueued.value)
    with pytest.raises(EnqueueError, match=r"^Payload #1: .*not a string") as many:
        Echo.enqueue_many([{"ok": 1}, payload])
    assert where in str(many.value)
    assert not WorkItem.objects.exists()


def test_string_keys_that_look_like_numbers_and_tuples_are_accepted() -> None:
    # Only a key's type is refused; tuples are JSON arrays and arrive as lists
    # (Django Tasks' args are tuples).
    payload = {"1": 1, "2.5": [1, (2, 3)], "null": None, "true": {"false": "1e+20"}}
    item = Echo.enqueue(payload)
    assert WorkItem.objects.get(pk=item.pk).payload == {
        "1": 1,
        "2.5": [1, [2, 3]],
        "null": None,
        "true": {"false": "1e+20"},
    }


def test_enqueue_error_is_a_value_error() -> None:
    assert issubclass(EnqueueError, ValueError)


def test_payload_size_limit() -> None:
    with override_settings(DBWORKER={"MAX_PAYLOAD_BYTES": 100}):
        Noop.enqueue("x" * 90)
        with pytest.raises(EnqueueError, match="more than MAX_PAYLOAD_BYTES"):
            Noop.enqueue("x" * 200)
    assert WorkItem.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_enqueue_is_transactional() -> None:
    def enqueue_then_fail() -> None:
        with transaction.atomic():
            Noop.enqueue({"rolled": "back"})
            raise RuntimeError

    with pytest.raises(RuntimeError):
        enqueue_then_fail()
    assert not WorkItem.objects.exists()
    with transaction.atomic():
        Noop.enqueue({"committed": True})
    assert WorkItem.objects.count() == 1


def test_unique_key_returns_the_live_row() -> None:
    first = Echo.enqueue({"n": 1}, unique_key="report:7")
    second = Echo.enqueue({"n": 2}, unique_key="report:7")
    assert second.pk == first.pk and second.payload == {"n": 1}
    other_handler = Noop.enqueue({}, unique_key="report:7")
    assert other_handler.pk != first.pk
    assert WorkItem.objects.count() == 2


def test_unique_key_is_free_again_once_the_row_finished() -> None:
    first = Echo.enqueue({}, unique_key="k")
    WorkItem.objects.filter(pk=first.pk).update(status=Status.SUCCEEDED)
    again = Echo.enqueue({}, unique_key="k")
    assert again.pk != first.pk


@pytest.mark.django_db(transaction=True)
def test_unique_key_conflict_does_not_break_the_callers_transaction() -> None:
    with transaction.atomic():
        a = Echo.enqueue({}, unique_key="k")
        b = Echo.enqueue({}, unique_key="k")
        c = Noop.enqueue({})  # the transaction is still usable
    assert a.pk == b.pk
    assert WorkItem.objects.filter(pk__in=[a.pk, c.pk]).count() == 2


@pytest.mark.django_db(transaction=True)
def test_unique_key_conflict_does_not_break_a_transaction_without_autocommit() -> None:
    """``AUTOCOMMIT: False``: the caller's transaction is open outside any atomic block."""
    connection.set_autocommit(False)
    try:
        a = Echo.enqueue({}, unique_key="k")
        b = Echo.enqueue({}, unique_key="k")
        c = Noop.enqueue({})  # the transaction is still usable
        connection.commit()
    finally:
        connection.rollback()
        connection.set_autocommit(True)
    assert a.pk == b.pk
    assert WorkItem.objects.filter(pk__in=[a.pk, c.pk]).count() == 2


def test_enqueue_many_is_one_insert() -> None:
    # Within one statement's worth on every vendor: Django gives SQLite at
    # most 999 parameters per statement, one per column of each row.
    columns = len([f for f in WorkItem._meta.concrete_fields if f.name != "id"])
    count = 999 // columns
    payloads = [{"n": n} for n in range(count)]
    with CaptureQueriesContext(connection) as ctx:
        items = Echo.enqueue_many(payloads, priority=3)
    inserts = [q for q in ctx.captured_queries if "INSERT INTO" in q["sql"].upper()]
    assert len(inserts) == 1
    assert len(items) == count and all(i.pk for i in items)
    assert sorted(WorkItem.objects.values_list("payload__n", flat=True)) == list(range(count))


def test_enqueue_many_validates_everything_first() -> None:
    with pytest.raises(EnqueueError, match=r"Payload #2: Payload is not JSON-serialisable"):
        enqueue_many("noop", [1, 2, {1, 2}, 4])
    with pytest.raises(EnqueueError, match="iterable of payloads"):
        enqueue_many("noop", {"a": 1})
    assert not WorkItem.objects.exists()
    assert enqueue_many("noop", []) == []


def test_handler_class_is_accepted_as_name() -> None:
    assert enqueue(Echo, 1).handler == "echo"
    with pytest.raises(EnqueueError):
        enqueue(InvoiceMailer, 1)  # type: ignore[arg-type]


def test_enqueue_many_returns_saved_items_in_order_with_db_values() -> None:
    items = Echo.enqueue_many([{"n": n} for n in range(5)] + [None], run_after=timedelta(hours=1))
    rows = {r.pk: r for r in WorkItem.objects.all()}
    assert [rows[i.pk].payload for i in items] == [{"n": n} for n in range(5)] + [None]
    assert all(i.run_after == rows[i.pk].run_after for i in items)
    assert all(i.created_at is not None and not i._state.adding for i in items)
    assert not WorkItem.objects.ready().exists()


def test_a_unique_key_with_a_nul_character_is_refused() -> None:
    with pytest.raises(EnqueueError, match="unique_key contains a NUL character"):
        Echo.enqueue({}, unique_key="a\x00b")
    assert not WorkItem.objects.exists()


def test_a_payload_nested_too_deeply_is_refused() -> None:
    payload: list[object] = []
    for _ in range(100_000):
        payload = [payload]
    with pytest.raises(EnqueueError, match="nested too deeply"):
        Echo.enqueue(payload)
    assert not WorkItem.objects.exists()


# -- enqueue_many by COPY (PostgreSQL, batches of COPY_THRESHOLD or more) -------------------

#: Payloads that COPY's text format could get wrong: backslashes and what
#: looks like its escapes, JSON's own escapes, non-ASCII text, nesting, nulls.
AWKWARD_PAYLOADS: list[object] = [
    None,
    {"text": "naïve café, 東京, emoji 🎉, rtl עברית"},
    {"nested": {"list": [1, [2, [3, {"deep": None}]]], "empty": {}, "none": None}},
    ["tab\there", "newline\nthere", "cr\rhere", "back\\slash", "\\N", "\\t", "\\\\"],
    "\\N",
    "",
    0,
    -12345678901234567890,
    0.1,
    True,
    [],
    {},
    {"quote": "\"'", "control": "\x01\x1f\x7f", "surrogate-free": "\u2028\u2029"},
]


def _threshold() -> int:
    from django_dbworker.db import postgresql

    return postgresql.COPY_THRESHOLD


def _batch(n: int) -> list[object]:
    return [AWKWARD_PAYLOADS[i % len(AWKWARD_PAYLOADS)] for i in range(n)] + [{"last": n}]


def _stored(items: list[WorkItem]) -> list[tuple[object, ...]]:
    """Every column of the items' rows but id and the times, in the items' order."""
    rows = {r.pk: r for r in WorkItem.objects.filter(pk__in=[i.pk for i in items])}
    assert len(rows) == len(items)
    return [
        (
            rows[i.pk].handler,
            rows[i.pk].queue,
            rows[i.pk].payload,
            rows[i.pk].status,
            rows[i.pk].priority,
            rows[i.pk].attempts,
            rows[i.pk].max_attempts,
            rows[i.pk].claimed_by,
            rows[i.pk].claim_token,
            rows[i.pk].last_error,
            rows[i.pk].result,
            rows[i.pk].unique_key,
            rows[i.pk].trace_context,
        )
        for i in items
    ]


def _assert_returned_as_stored(items: list[WorkItem], payloads: list[object]) -> None:
    """The returned items hold what the rows hold: ids in payload order, DB times."""
    assert [i.payload for i in items] == payloads
    assert [i.pk for i in items] == sorted(i.pk for i in items)
    assert len({i.pk for i in items}) == len(items)
    rows = {r.pk: r for r in WorkItem.objects.filter(pk__in=[i.pk for i in items])}
    for item in items:
        row = rows[item.pk]
        assert row.payload == item.payload
        assert (item.run_after, item.created_at, item.updated_at) == (
            row.run_after,
            row.created_at,
            row.updated_at,
        )
        assert not item._state.adding and item._state.db == "default"


@pytest.mark.postgres_only
def test_a_copy_batch_returns_its_items_in_order_with_ids_and_database_times() -> None:
    payloads = _batch(_threshold() * 3)
    with CaptureQueriesContext(connection) as ctx:
        items = Echo.enqueue_many(payloads, priority=7)
    statements = [q["sql"].lstrip().split(None, 1)[0].upper() for q in ctx.captured_queries]
    assert "COPY" in statements and "INSERT" not in statements
    _assert_returned_as_stored(items, payloads)
    assert {(i.handler, i.queue, i.priority, i.max_attempts) for i in items} == {
        ("echo", "echoes", 7, 3)
    }
    assert len({(i.created_at, i.updated_at, i.run_after) for i in items}) == 1
    assert items[0].created_at == items[0].updated_at == items[0].run_after
    assert WorkItem.objects.ready().count() == len(payloads)
    # The stored null payload is SQL NULL, as the one-statement insert stores it.
    assert WorkItem.objects.filter(pk=items[0].pk, payload__isnull=True).exists()


@pytest.mark.parametrize(
    "run_after",
    [None, timedelta(minutes=5), dt.datetime(2031, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC)],
    ids=["now", "delay", "run_at"],
)
def test_batches_over_and_under_the_copy_threshold_store_the_same(run_after: object) -> None:
    # On SQLite both sizes take its one bulk insert; on PostgreSQL the large
    # one goes by COPY and the small one by INSERT ... unnest.
    large = _batch(_threshold() + 5)
    small = large[: _threshold() - 1]
    by_copy = Echo.enqueue_many(large, priority=-3, queue="q.copy", run_after=run_after)  # type: ignore[arg-type]
    by_insert = Echo.enqueue_many(small, priority=-3, queue="q.copy", run_after=run_after)  # type: ignore[arg-type]
    _assert_returned_as_stored(by_copy, large)
    _assert_returned_as_stored(by_insert, small)
    assert _stored(by_copy)[: len(small)] == _stored(by_insert)
    assert by_insert[0].pk > by_copy[-1].pk
    for items in (by_copy, by_insert):
        first = items[0]
        assert first.created_at == first.updated_at
        if run_after is None:
            assert first.run_after == first.created_at
        elif isinstance(run_after, timedelta):
            assert first.run_after == first.created_at + run_after
        else:
            assert first.run_after == run_after
    ready = WorkItem.objects.ready().filter(queue="q.copy").count()
    assert ready == (len(large) + len(small) if run_after is None else 0)


def test_single_enqueue_stores_awkward_payloads_exactly() -> None:
    for payload in AWKWARD_PAYLOADS:
        item = Echo.enqueue(payload)
        assert WorkItem.objects.get(pk=item.pk).payload == payload
        assert item.created_at == item.updated_at == item.run_after


@pytest.mark.postgres_only
def test_prepared_enqueue_statements_give_the_same_items(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With a prepare_threshold (DATABASES OPTIONS), the enqueue statements run
    # on a server-binding cursor that psycopg prepares; the items must not differ.
    connection.ensure_connection()
    monkeypatch.setattr(connection.connection, "prepare_threshold", 0)
    payloads = _batch(_threshold() + 1)
    with CaptureQueriesContext(connection) as ctx:
        one = [Echo.enqueue(p, run_after=timedelta(seconds=30)) for p in payloads[:5]]
        small = Echo.enqueue_many(payloads[:5], run_after=timedelta(seconds=30))
        large = Echo.enqueue_many(payloads, run_after=timedelta(seconds=30))
    assert len(ctx.captured_queries) >= 5 + 1 + 3  # logged like Django's own cursors
    assert connection.connection._prepared._names  # psycopg prepared them
    _assert_returned_as_stored(one, payloads[:5])
    _assert_returned_as_stored(small, payloads[:5])
    _assert_returned_as_stored(large, payloads)
    assert _stored(one) == _stored(small) == _stored(large)[:5]
    assert all(i.run_after == i.created_at + timedelta(seconds=30) for i in one + small + large)


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_enqueues_in_a_rolled_back_transaction_leave_nothing_and_wake_no_one() -> None:
    from django_dbworker.db import operations

    def enqueue_then_fail() -> None:
        with transaction.atomic():
            Echo.enqueue_many(_batch(_threshold()), queue="rolled.back")
            Echo.enqueue_many([1, 2], queue="rolled.back")
            Echo.enqueue(None, queue="rolled.back")
            assert WorkItem.objects.filter(queue="rolled.back").count() == _threshold() + 4
            raise RuntimeError

    subscription = operations().listen()
    try:
        with pytest.raises(RuntimeError):
            enqueue_then_fail()
        assert not WorkItem.objects.exists()
        Echo.enqueue_many(_batch(_threshold()), queue="committed")
        with transaction.atomic():
            Echo.enqueue(None, queue="committed.single")
            Echo.enqueue_many(_batch(_threshold()), queue="committed.single")
        Noop.enqueue(None, queue="marker")
        # Wake-ups arrive in commit order: everything sent before the marker's
        # commit has arrived by the time the marker does.
        received = []
        for queue in subscription.receive(20.0):
            received.append(queue)
            if queue == "marker":
                break
    finally:
        subscription.close()
    # One wake-up per queue and commit, in commit order; none for the rollback.
    assert received == ["committed", "committed.single", "marker"]
    assert WorkItem.objects.filter(queue="committed").count() == _threshold() + 1


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_a_copy_batch_that_fails_after_reserving_ids_leaves_nothing() -> None:
    # Another connection holds a lock that blocks inserts, and lock_timeout
    # makes the COPY give up: the failure comes after the ids were reserved,
    # the batch's transaction rolls back whole, the connection stays usable.
    from django.db import OperationalError

    other = connection.get_new_connection(connection.get_connection_params())
    try:
        other.execute("LOCK TABLE django_dbworker_workitem IN SHARE MODE")
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '200ms'")
        try:
            with pytest.raises(OperationalError, match="lock timeout"):
                Echo.enqueue_many(_batch(_threshold()))
        finally:
            with connection.cursor() as cursor:
                cursor.execute("RESET lock_timeout")
    finally:
        other.close()
    assert not WorkItem.objects.exists()
    items = Echo.enqueue_many(_batch(_threshold()))
    _assert_returned_as_stored(items, _batch(_threshold()))


def test_new_item_matches_the_model_constructor() -> None:
    from django.db.models.signals import post_init

    from django_dbworker.enqueuing import _item_maker, _new_item

    values = {
        "handler": "echo",
        "queue": "q",
        "payload": {"a": [1]},
        "priority": 2,
        "max_attempts": 4,
        "unique_key": None,
    }
    fast, real = _new_item(values), WorkItem(**values)
    assert list(fast.__dict__) == list(real.__dict__)
    for name, value in real.__dict__.items():
        if name in ("_state", "run_after", "created_at", "updated_at"):
            assert type(fast.__dict__[name]) is type(value)
        else:
            assert fast.__dict__[name] == value, name
    assert fast._state.adding and fast._state.db is None
    assert fast.trace_context is not _new_item(values).trace_context
    assert _item_maker() is _new_item
    seen: list[object] = []

    def receiver(sender: object, instance: object, **kwargs: object) -> None:
        seen.append(instance)

    post_init.connect(receiver, sender=WorkItem)
    try:
        item = _item_maker()(values)
        items = Echo.enqueue_many([1, 2])
    finally:
        post_init.disconnect(receiver, sender=WorkItem)
    assert seen[0] is item and seen[1:] == items


def test_aenqueue_takes_the_sync_forms_arguments_and_refuses_the_same_bad_input() -> None:
    """``Handler.aenqueue`` and ``django_dbworker.aenqueue`` from async code: the same insert
    and options as ``enqueue``; bad input raises the same ``EnqueueError``, writing nothing."""
    from asgiref.sync import async_to_sync

    from django_dbworker import aenqueue

    item = async_to_sync(Echo.aenqueue)({"a": 1}, priority=3, unique_key="once")
    again = async_to_sync(Echo.aenqueue)({"a": 2}, unique_key="once")
    assert again.pk == item.pk and item.priority == 3 and item.queue == Echo.queue
    named = async_to_sync(aenqueue)("noop", [1], max_attempts=2, after=[item])
    assert (named.handler, named.payload, named.max_attempts) == ("noop", [1], 2)
    with pytest.raises(EnqueueError, match="nope"):
        async_to_sync(aenqueue)("nope")
    assert WorkItem.objects.count() == 2
