"""OpenTelemetry spans for enqueue (PRODUCER) and execution (CONSUMER).

Follows the messaging semantic conventions so that tracing backends draw
the hop from the request that enqueued a job to each attempt that ran it:
enqueue opens ``send {queue}`` and stores its W3C context in
``WorkItem.trace_context``; each attempt opens ``process {queue}`` whose
parent is that stored context, so retries are separate spans of one trace.

Only ``opentelemetry-api`` is used (the ``otel`` extra). Without it, or
while no SDK tracer provider is configured, every helper here returns a
no-op at the cost of one ``isinstance`` check. Payloads never become span
attributes; for ``sensitive`` handlers not even exception messages do.

``opentelemetry`` is not imported until something else has imported its
``trace`` module (an SDK's setup, the auto-instrumentation, a project's own
spans) or the environment names a tracer provider: until then no provider
can be configured, and every Django process that loads this app (the web
workers, each ``manage.py`` command, each worker's start) would import
the API for nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from django_dbworker.errortext import error_summary, format_error

if TYPE_CHECKING:
    from django_dbworker.handlers import WorkItemHandler
    from django_dbworker.models import WorkItem

SYSTEM = "django_dbworker"
_provider_override: Any = None


def use_tracer_provider(provider: Any) -> None:
    """Use ``provider`` instead of the global one (tests inject an in-memory one)."""
    global _provider_override
    _provider_override = provider


#: The environment variable through which opentelemetry loads a tracer provider itself.
_PROVIDER_VARIABLE = "OTEL_PYTHON_TRACER_PROVIDER"


def _trace_api() -> Any:
    """``opentelemetry.trace``, or None while no tracer provider can be configured.

    A provider is set through that module, so while nothing has imported
    it (and no injected provider or environment variable names one) none
    is, and the API is not imported for nothing. None too without the
    ``otel`` extra.
    """
    module = sys.modules.get("opentelemetry.trace")
    if module is not None:
        return module
    if _provider_override is None and _PROVIDER_VARIABLE not in os.environ:
        return None
    try:
        from opentelemetry import trace
    except ImportError:  # the optional extra is not installed
        return None
    return trace


def _tracer() -> Any:
    trace = _trace_api()
    if trace is None:
        return None
    provider = _provider_override or trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None  # no SDK configured: tracing must cost nothing
    from django_dbworker.version import __version__

    return provider.get_tracer("django_dbworker", __version__)


class _Send:
    """The PRODUCER span of one enqueue, or a stand-in when tracing is off."""

    def __init__(self, span: Any = None) -> None:
        self.span = span
        self.context: dict[str, str] = {}
        if span is not None:
            from opentelemetry import propagate

            propagate.inject(self.context)

    def set_message_id(self, item_id: int) -> None:
        if self.span is not None:
            self.span.set_attribute("messaging.message.id", str(item_id))

    # Used directly as the context manager when tracing is off: no generator,
    # no span, nothing but this object.
    def __enter__(self) -> _Send:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _Attempt:
    """The CONSUMER span of one attempt (``span`` is None when tracing is off)."""

    def __init__(self, span: Any = None) -> None:
        self.span = span

    def outcome(self, outcome: str) -> None:
        if self.span is not None:
            self.span.set_attribute("dbworker.outcome", outcome)

    def __enter__(self) -> _Attempt:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def sending(queue: str, handler: str, *, batch_size: int | None = None) -> Any:
    """Wrap an enqueue; ``.context`` is the carrier to store in ``trace_context``."""
    tracer = _tracer()
    if tracer is None:
        return _Send()
    return _sending(tracer, queue, handler, batch_size)


@contextmanager
def _sending(tracer: Any, queue: str, handler: str, batch_size: int | None) -> Iterator[_Send]:
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.name": "send",
        "messaging.operation.type": "send",
        "messaging.destination.name": queue,
        "worker.name": handler,
    }
    if batch_size is not None:
        attributes["messaging.batch.message_count"] = batch_size
    from opentelemetry.trace import SpanKind

    with tracer.start_as_current_span(
        f"send {queue}", kind=SpanKind.PRODUCER, attributes=attributes
    ) as span:
        yield _Send(span)


_OFF = _Attempt()


def processing(item: WorkItem, handler: WorkItemHandler) -> Any:
    """The CONSUMER span of one attempt, parented to the enqueuer's context."""
    tracer = _tracer()
    if tracer is None:
        return _OFF
    return _processing(tracer, item, handler)


@contextmanager
def _processing(tracer: Any, item: WorkItem, handler: WorkItemHandler) -> Iterator[_Attempt]:
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    parent = propagate.extract(_carrier(item.trace_context))
    attributes = {
        "messaging.system": SYSTEM,
        "messaging.operation.name": "process",
        "messaging.operation.type": "process",
        "messaging.destination.name": item.queue,
        "messaging.message.id": str(item.pk),
        "worker.name": handler.name,
        "dbworker.attempt": item.attempts,
    }
    with tracer.start_as_current_span(
        f"process {item.queue}",
        context=parent,
        kind=SpanKind.CONSUMER,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        yield _Attempt(span)


def _carrier(value: Any) -> dict[str, str]:
    """The stored context as a W3C carrier; anything malformed is ignored.

    ``trace_context`` is data from the table (written by any version, or by
    hand): a bad value must cost the trace its parent, never the attempt.
    """
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}


def record_failure(exc: BaseException, *, sensitive: bool) -> None:
    """Record ``exc`` on the current attempt's span and mark it ERROR."""
    trace = _trace_api()
    if trace is None:
        return
    span = trace.get_current_span()
    if not span.is_recording():
        return
    kind = type(exc).__qualname__
    if sensitive:
        # The message (and traceback locals) may quote the payload.
        span.add_event("exception", {"exception.type": kind})
        span.set_status(trace.StatusCode.ERROR, kind)
    else:
        summary = error_summary(exc)  # never raises, unlike str(exc)
        span.add_event(
            "exception",
            {
                "exception.type": kind,
                "exception.message": summary.partition(": ")[2],
                "exception.stacktrace": format_error(exc),
            },
        )
        span.set_status(trace.StatusCode.ERROR, summary)
