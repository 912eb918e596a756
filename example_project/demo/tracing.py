"""OpenTelemetry for the example project, the way a user would set it up.

The exporter is chosen by the standard OTEL_TRACES_EXPORTER variable:
``console`` prints finished spans to stderr, ``otlp`` sends them over
OTLP/HTTP to OTEL_EXPORTER_OTLP_ENDPOINT. Requests are traced by
opentelemetry-instrumentation-django; django-dbworker adds the enqueue and
job spans, so one trace runs from the HTTP request to the job.
"""

from __future__ import annotations

import os


def configure() -> None:
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter_name in ("", "none"):
        return
    from opentelemetry import trace
    from opentelemetry.instrumentation.django import DjangoInstrumentor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    elif exporter_name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    else:
        raise RuntimeError(f"OTEL_TRACES_EXPORTER={exporter_name!r}: use console, otlp or none")
    service = os.environ.get("OTEL_SERVICE_NAME", "django-dbworker-example")
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    DjangoInstrumentor().instrument()
