"""Spans against an in-memory exporter: request -> send -> process, errors, secrets."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db.models.functions import Now
from django.test import Client
from opentelemetry.instrumentation.django import DjangoInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from django_dbworker import tracing
from django_dbworker.models import WorkItem
from django_dbworker.testing import run_until_empty
from tests.testapp.workers import Flaky, Noop, Secret

pytestmark = pytest.mark.django_db


@pytest.fixture
def exporter() -> Iterator[tuple[InMemorySpanExporter, TracerProvider]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_tracer_provider(provider)
    yield exporter, provider
    tracing.use_tracer_provider(None)


def by_name(spans: Any, name: str) -> list[Any]:
    return [s for s in spans if s.name == name]


def all_text(span: Any) -> str:
    parts = [str(v) for v in span.attributes.values()]
    for event in span.events:
        parts += [str(v) for v in event.attributes.values()]
    parts.append(str(span.status.description))
    return " ".join(parts)


def test_one_trace_from_request_to_job(exporter: Any, client: Client) -> None:
    memory, provider = exporter
    DjangoInstrumentor().instrument(tracer_provider=provider)
    try:
        response = Client().post("/enqueue/")
    finally:
        DjangoInstrumentor().uninstrument()
    assert response.status_code == 200
    assert run_until_empty(handlers=["echo"]) == {"succeeded": 1}
    spans = memory.get_finished_spans()
    (server,) = [s for s in spans if s.kind == SpanKind.SERVER]
    (send,) = by_name(spans, "send echoes")
    (process,) = by_name(spans, "process echoes")
    assert send.kind == SpanKind.PRODUCER and process.kind == SpanKind.CONSUMER
    trace_id = server.context.trace_id
    assert send.context.trace_id == trace_id == process.context.trace_id
    assert send.parent.span_id == server.context.span_id
    assert process.parent.span_id == send.context.span_id
    item_id = str(response.json()["id"])
    assert send.attributes["messaging.system"] == "django_dbworker"
    assert send.attributes["messaging.operation.name"] == "send"
    assert send.attributes["messaging.destination.name"] == "echoes"
    assert send.attributes["messaging.message.id"] == item_id
    assert process.attributes["messaging.operation.name"] == "process"
    assert process.attributes["messaging.message.id"] == item_id
    assert process.attributes["worker.name"] == "echo"
    assert process.attributes["dbworker.attempt"] == 1
    assert process.status.status_code != StatusCode.ERROR
    for span in spans:
        assert "s3cr3t-payload" not in all_text(span)  # payloads never become attributes
    row = WorkItem.objects.get(pk=item_id)
    assert row.trace_context["traceparent"].split("-")[1] == f"{trace_id:032x}"


@pytest.mark.usefixtures("slow_retries")
def test_retries_are_separate_spans_of_one_trace_with_errors(exporter: Any) -> None:
    memory, _ = exporter
    Flaky.enqueue({"key": "t", "fail_times": 1})
    assert run_until_empty() == {"retried": 1}
    WorkItem.objects.update(run_after=Now())
    assert run_until_empty() == {"succeeded": 1}
    (send,) = by_name(memory.get_finished_spans(), "send default")
    first, second = by_name(memory.get_finished_spans(), "process default")
    assert first.context.trace_id == second.context.trace_id == send.context.trace_id
    assert first.parent.span_id == second.parent.span_id == send.context.span_id
    assert (first.attributes["dbworker.attempt"], second.attributes["dbworker.attempt"]) == (1, 2)
    assert first.status.status_code == StatusCode.ERROR
    assert "ConnectionError" in first.status.description
    assert [e.name for e in first.events] == ["exception"]
    assert first.attributes["dbworker.outcome"] == "retried"
    assert second.status.status_code != StatusCode.ERROR
    assert second.attributes["dbworker.outcome"] == "succeeded"


def test_sensitive_failures_keep_the_message_out_of_spans(exporter: Any) -> None:
    memory, _ = exporter
    Secret.enqueue({"password": "hunter2"})
    run_until_empty(handlers=["secret"])
    (process,) = by_name(memory.get_finished_spans(), "process default")
    assert process.status.status_code == StatusCode.ERROR
    assert process.events[0].attributes["exception.type"] == "ValueError"
    assert "hunter2" not in all_text(process)


def test_enqueue_many_is_one_send_span(exporter: Any) -> None:
    memory, _ = exporter
    items = Noop.enqueue_many([1, 2, 3])
    (send,) = by_name(memory.get_finished_spans(), "send default")
    assert send.attributes["messaging.batch.message_count"] == 3
    assert all(i.trace_context["traceparent"] for i in items)


def test_without_an_sdk_nothing_is_recorded_or_stored() -> None:
    item = Noop.enqueue(None)
    assert WorkItem.objects.get(pk=item.pk).trace_context == {}
    assert run_until_empty() == {"succeeded": 1}


def test_a_batch_callback_is_sent_like_any_enqueue_and_joins_the_last_items_trace(
    exporter: Any,
) -> None:
    """The callback goes through the one insert path: a PRODUCER span, in the trace of the
    attempt whose ending completed the batch."""
    from django_dbworker.batches.block import batch
    from tests.testapp.workers import BatchDone

    memory, _ = exporter
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue({})
    assert run_until_empty(handlers=["noop"]) == {"succeeded": 1}
    spans = memory.get_finished_spans()
    (process,) = by_name(spans, "process default")
    (callback,) = WorkItem.objects.filter(handler=BatchDone.name)
    (send,) = [
        s
        for s in spans
        if s.kind == SpanKind.PRODUCER and s.attributes["messaging.message.id"] == str(callback.pk)
    ]
    assert send.attributes["worker.name"] == BatchDone.name
    assert send.context.trace_id == process.context.trace_id
    assert callback.batch_id is None and callback.payload["batch"] == b.id


@pytest.mark.django_db(transaction=True)
def test_async_attempts_overlapping_on_the_loop_are_each_their_own_span(exporter: Any) -> None:
    """Coroutines interleave on one thread; each attempt's CONSUMER span is its own, the
    child of its own item's send span, never of another attempt's."""
    import threading

    from django_dbworker.worker import Worker
    from tests.factories import worker_config
    from tests.testapp.workers import AsyncSleep

    memory, _ = exporter
    items = [AsyncSleep.enqueue({"key": f"t{i}", "seconds": 0.2}) for i in range(3)]
    worker = Worker([AsyncSleep], worker_config(burst=True))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and dict(worker.outcomes) == {"succeeded": 3}
    spans = memory.get_finished_spans()
    sends = {s.attributes["messaging.message.id"]: s for s in by_name(spans, "send default")}
    processes = by_name(spans, "process default")
    assert sorted(s.attributes["messaging.message.id"] for s in processes) == sorted(
        str(item.pk) for item in items
    )
    for process in processes:
        send = sends[process.attributes["messaging.message.id"]]
        assert process.parent.span_id == send.context.span_id
        assert process.attributes["dbworker.outcome"] == "succeeded"
