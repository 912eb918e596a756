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


def test_enqueue_many_is_one_insert() -> None:
    payloads = [{"n": n} for n in range(50)]
    with CaptureQueriesContext(connection) as ctx:
        items = Echo.enqueue_many(payloads, priority=3)
    inserts = [q for q in ctx.captured_queries if "INSERT INTO" in q["sql"].upper()]
    assert len(inserts) == 1
    assert len(items) == 50 and all(i.pk for i in items)
    assert sorted(WorkItem.objects.values_list("payload__n", flat=True)) == list(range(50))


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
