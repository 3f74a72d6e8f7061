"""What OpenTelemetry export costs the training thread: ns per step (two phases) with the tracer
alone, with step spans and metrics on (the step is only queued; spans and points are made in the
tracer's flush), and what making the three spans on the training thread would cost instead.

    python bench/otel_bench.py [--steps 20000] [--repeats 3]

The SDK is real (a TracerProvider with a BatchSpanProcessor and a MeterProvider with an in-memory
reader); nothing is exported over the network. The best of ``--repeats`` runs is reported.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ranklens.tracing.otel import StepSpans
from ranklens.tracing.tracer import Tracer


def per_step_ns(spans: StepSpans | None, steps: int, repeats: int) -> float:
    t = Tracer(job_id="bench", attempt=0, rank=0, world_size=1, spool_dir=tempfile.mkdtemp(),
               flush_interval_s=3600, max_buffered=10 * steps)  # fmt: skip
    t.spans = spans
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for n in range(steps):
            with t.step(n):
                with t.phase("forward"):
                    pass
                with t.phase("backward"):
                    pass
        best = min(best, (time.perf_counter_ns() - t0) / steps)
        t._take()  # drop what was buffered (never flushed here)
        if spans is not None:
            spans._queue.clear()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.steps < 1 or args.repeats < 1:
        ap.error("--steps and --repeats must be at least 1")
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter(), max_queue_size=args.steps * 3))
    meters = MeterProvider(metric_readers=[InMemoryMetricReader()])
    spans = StepSpans(provider, job_id="bench", attempt=0, rank=0, meter_provider=meters)
    off = per_step_ns(None, args.steps, args.repeats)
    on = per_step_ns(spans, args.steps, args.repeats)
    best = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter_ns()
        for n in range(args.steps):
            spans._span(n, 1, 2, [("forward", 1, 2), ("backward", 1, 2)])
        best = min(best, (time.perf_counter_ns() - t0) / args.steps)
    print(f"tracer alone:              {off / 1000:8.2f} us a step (two phases)")
    print(f"with spans and metrics on: {on / 1000:8.2f} us a step ({(on - off) / 1000:+.2f} us on the training thread)")
    print(f"the 3 spans made inline:   {best / 1000:8.2f} us a step (what the flush now does off that thread)")
    provider.shutdown()
    meters.shutdown()


if __name__ == "__main__":
    main()
