"""Cost of the tracing hooks per job, with and without an OpenTelemetry SDK.

    .venv/bin/python bench/tracing_overhead.py [--iterations 200000]

Times the hooks that every enqueue and every attempt go through
(``tracing.sending``, and ``tracing.processing`` with the attempt's outcome),
first with no SDK configured (the default), then with an SDK tracer
provider and a no-op exporter, against an empty loop. No database needed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
# The hooks never touch the database; bench.settings wants a URL all the same.
os.environ.setdefault("DATABASE_URL", "sqlite://:memory:")


def per_call_ns(fn, iterations: int) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm up
    started = time.perf_counter_ns()
    for _ in range(iterations):
        fn()
    return (time.perf_counter_ns() - started) / iterations


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=200_000)
    args = parser.parse_args()
    import django

    django.setup()
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    from bench.benchapp.workers import BenchNoop
    from django_dbworker import tracing
    from django_dbworker.models import WorkItem

    item = WorkItem(pk=1, handler="bench_noop", queue="default", attempts=1, trace_context={})
    handler = BenchNoop()

    def hooks() -> None:
        with tracing.sending("default", "bench_noop") as send:
            send.set_message_id(1)
        with tracing.processing(item, handler) as attempt:
            attempt.outcome("succeeded")

    def empty() -> None:
        pass

    baseline = per_call_ns(empty, args.iterations)
    off = per_call_ns(hooks, args.iterations)

    class Discard(SpanExporter):
        def export(self, spans):  # type: ignore[no-untyped-def]
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Discard()))
    tracing.use_tracer_provider(provider)
    on = per_call_ns(hooks, max(1000, args.iterations // 20))
    tracing.use_tracer_provider(None)
    result = {
        "bench": "tracing_overhead",
        "empty_loop_ns": round(baseline),
        "no_sdk_ns_per_job": round(off - baseline),
        "sdk_ns_per_job": round(on - baseline),
        "iterations": args.iterations,
    }
    import json

    print(json.dumps(result))
    print(f"  hooks per job without SDK: {result['no_sdk_ns_per_job']} ns", file=sys.stderr)
    print(f"  hooks per job with SDK:    {result['sdk_ns_per_job']} ns", file=sys.stderr)


if __name__ == "__main__":
    main()
