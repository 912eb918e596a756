"""Sensitive data at enqueue: what no database can store, and database errors that quote rows.

A payload is checked for the text no database stores (NUL, lone
surrogates) before anything is written, with an error that names where,
never what. And for a ``sensitive`` handler, a database error raised by the
write (PostgreSQL's DETAIL and CONTEXT quote the row, payload included)
reaches neither the caller's exception, nor the enqueue span, nor a log
line: the error keeps its class, its text is withheld.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import DatabaseError, IntegrityError, connection
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from django_dbworker import EnqueueError, enqueue, tracing
from django_dbworker.models import WorkItem
from tests.testapp import tasks
from tests.testapp.workers import Echo, Secret

pytestmark = pytest.mark.django_db

SECRET = "s3cr3t-marker"

#: What ``json.loads`` makes of a JSON string holding an unpaired surrogate escape.
LONE_SURROGATE = json.loads('"\\ud800"')

SURROGATE_PAYLOADS = [
    f"{SECRET} {LONE_SURROGATE}",
    {"password": f"{SECRET}{LONE_SURROGATE}"},
    {f"{SECRET}\udfff": "in a key"},
    {"a": [1, {"b": ["fine", (SECRET, {"c": "nested \udc80"})]}]},
    [{"k": "😀"}, {SECRET: {"deep\udbff": None}}],
    {"C:\\ud800": "\\udc00", "z": f"{SECRET}\\{LONE_SURROGATE}"},  # literal escapes, then one
]


def _texts(exc: BaseException) -> str:
    """Everything an exception shows: its text, its chain's texts."""
    parts = []
    current: BaseException | None = exc
    while current is not None:
        parts.append(f"{type(current).__name__}: {current} {current.args!r}")
        current = current.__cause__ or (
            None if current.__suppress_context__ else current.__context__
        )
    return " ".join(parts)


@pytest.mark.parametrize("payload", SURROGATE_PAYLOADS)
@pytest.mark.parametrize("handler", [Echo, Secret])
def test_a_lone_surrogate_in_a_payload_is_refused_without_quoting_it(
    handler: type[Echo] | type[Secret], payload: object
) -> None:
    # PostgreSQL's jsonb refuses an unpaired surrogate escape with a DataError
    # whose CONTEXT quotes the payload; SQLite stores it. Refused on every
    # database, before anything is written, like a NUL.
    with pytest.raises(EnqueueError, match="lone surrogate") as enqueued:
        handler.enqueue(payload)
    with pytest.raises(EnqueueError, match=r"^Payload #1: .*lone surrogate") as many:
        handler.enqueue_many([{"ok": 1}, payload, {"ok": 2}])
    for exc in (enqueued.value, many.value):
        assert SECRET not in _texts(exc)
    assert not WorkItem.objects.exists()


def test_characters_beyond_the_basic_plane_are_not_surrogates() -> None:
    # json.dumps writes them as surrogate pairs ("\ud83d\ude00"): pairs are fine.
    payload = {"😀 key": ["\U0010ffff", "a😀b", {"x": "\U00010000"}], "plain": "\\ud800"}
    item = Echo.enqueue(payload)
    (many,) = Echo.enqueue_many([payload])
    assert WorkItem.objects.get(pk=item.pk).payload == payload
    assert WorkItem.objects.get(pk=many.pk).payload == payload


def test_a_lone_surrogate_in_a_unique_key_is_refused() -> None:
    with pytest.raises(EnqueueError, match="unique_key contains a lone surrogate") as raised:
        Secret.enqueue({}, unique_key=f"{SECRET}{LONE_SURROGATE}")
    assert SECRET not in _texts(raised.value)
    assert not WorkItem.objects.exists()


def test_a_sensitive_task_with_a_lone_surrogate_is_refused() -> None:
    with pytest.raises(EnqueueError, match="lone surrogate") as raised:
        tasks.secret.enqueue(f"{SECRET}{LONE_SURROGATE}")
    assert SECRET not in _texts(raised.value)
    assert not WorkItem.objects.exists()


# -- database errors at enqueue -----------------------------------------------------

#: The database refuses rows of this priority (the fixture below): a write
#: that passes validation and still fails in the database.
REFUSED_PRIORITY = 42

_TABLE = WorkItem._meta.db_table
_REFUSAL = "dbworker_test_refuse"


@pytest.fixture
def refusing_database() -> Iterator[None]:
    """Make the database refuse rows of ``REFUSED_PRIORITY``, in its own words.

    PostgreSQL's CHECK violation carries ``DETAIL: Failing row contains
    (...)``, the whole row, payload included: the text that must not reach
    a sensitive handler's caller, spans or logs.
    """
    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute(
                f"CREATE TRIGGER {_REFUSAL} BEFORE INSERT ON {_TABLE} "
                f"WHEN NEW.priority = {REFUSED_PRIORITY} "
                "BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
            )
        else:
            cursor.execute(
                f"ALTER TABLE {_TABLE} ADD CONSTRAINT {_REFUSAL} "
                f"CHECK (priority <> {REFUSED_PRIORITY})"
            )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            if connection.vendor == "sqlite":
                cursor.execute(f"DROP TRIGGER {_REFUSAL}")
            elif connection.vendor == "mysql":
                cursor.execute(f"ALTER TABLE {_TABLE} DROP CONSTRAINT {_REFUSAL}")
            else:
                cursor.execute(f"ALTER TABLE {_TABLE} DROP CONSTRAINT {_REFUSAL}")


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing.use_tracer_provider(provider)
    yield memory
    tracing.use_tracer_provider(None)


def _span_text(span: Any) -> str:
    parts = [str(v) for v in span.attributes.values()]
    for event in span.events:
        parts += [str(v) for v in event.attributes.values()]
    parts.append(str(span.status.description))
    return " ".join(parts)


def _refused_enqueues() -> list[tuple[str, Any]]:
    payload = {"password": SECRET}
    return [
        ("enqueue", lambda h: h.enqueue(payload, priority=REFUSED_PRIORITY)),
        ("enqueue_many", lambda h: h.enqueue_many([payload] * 3, priority=REFUSED_PRIORITY)),
        # PostgreSQL writes 100 or more rows with COPY.
        ("enqueue_many COPY", lambda h: h.enqueue_many([payload] * 150, priority=REFUSED_PRIORITY)),
        ("by name", lambda h: enqueue(h.name, payload, priority=REFUSED_PRIORITY)),
    ]


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("refusing_database")
@pytest.mark.parametrize(
    ("how", "call"), _refused_enqueues(), ids=[h for h, _ in _refused_enqueues()]
)
def test_a_database_error_at_enqueue_of_a_sensitive_handler_is_withheld(
    how: str, call: Any, exporter: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(IntegrityError) as refused:
        call(Secret)
    exc = refused.value
    # The class stays (callers catch IntegrityError, DatabaseError); the text goes.
    assert "withheld" in str(exc) and "sensitive" in str(exc), str(exc)
    assert "IntegrityError" in str(exc)
    assert exc.__cause__ is None and exc.__suppress_context__
    assert SECRET not in _texts(exc)
    spans = exporter.get_finished_spans()
    assert spans, "the enqueue opened no span"
    for span in spans:
        assert span.status.status_code == StatusCode.ERROR
        assert SECRET not in _span_text(span), _span_text(span)
    for record in caplog.records:
        assert SECRET not in record.getMessage()
        assert not record.exc_info or SECRET not in _texts(record.exc_info[1])
    assert not WorkItem.objects.exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("refusing_database")
def test_a_database_error_at_enqueue_of_a_plain_handler_keeps_its_text() -> None:
    with pytest.raises(IntegrityError) as refused:
        Echo.enqueue({"password": SECRET}, priority=REFUSED_PRIORITY)
    assert "withheld" not in str(refused.value)
    if connection.vendor == "postgresql":
        # What the sensitive handler's error would have said: the row itself.
        assert SECRET in str(refused.value)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("refusing_database")
def test_a_database_error_at_enqueue_of_a_sensitive_task_is_withheld(
    exporter: InMemorySpanExporter,
) -> None:
    with pytest.raises(DatabaseError) as refused:
        tasks.secret.using(priority=REFUSED_PRIORITY).enqueue(SECRET)
    assert "withheld" in str(refused.value)
    assert SECRET not in _texts(refused.value)
    for span in exporter.get_finished_spans():
        assert SECRET not in _span_text(span)
    assert not WorkItem.objects.exists()
