"""OpenTelemetry spans for `workbench serve` (off unless `--otel console|otlp`): one span per request.

Each chat request becomes a SERVER span named `chat MODEL` with the GenAI semantic conventions'
attributes (`gen_ai.operation.name`, `gen_ai.request.*`, `gen_ai.response.*`, `gen_ai.usage.*`) and
what this server adds under `k3wb.*`: the conversation, the trace directory the turn was recorded into
(so a span leads to its recording), the turn, the reused prefix and the time to the first token. The
span runs from the moment the request is queued to its last event; a refused or failed request ends
with an error status and its one-line message. The OpenTelemetry SDK does the rest (batching,
exporters): `console` prints spans to stdout, `otlp` sends them over OTLP/HTTP to
`OTEL_EXPORTER_OTLP_ENDPOINT` (the `opentelemetry-exporter-otlp-proto-http` package).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from apps.serve.events import Event, Failed, Finished, Started
from engine.errors import InputError

EXPORTERS = ("off", "console", "otlp")
SYSTEM = "k3_workbench"


class RequestTelemetry:
    """Spans of one server's requests, through one `TracerProvider` (`shutdown` flushes them)."""

    def __init__(self, exporter: Any, *, model: str, trace_root: Path | None = None, batch: bool = True) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        self.model, self.trace_root = model, trace_root
        self.provider = TracerProvider(resource=Resource.create({"service.name": "workbench-serve"}))
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("k3wb.serve")

    def observe(self, request: Any, request_id: str, emit: Callable[[Event], None]) -> Callable[[Event], None]:
        """`emit` wrapped so that the job's events also fill and end its span (started now, as it is queued)."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        span = self.tracer.start_span(f"chat {self.model}", kind=SpanKind.SERVER, start_time=time.time_ns(),
                                      attributes=_request_attributes(request, self.model))
        span.set_attribute("gen_ai.response.id", request_id)
        ended = False

        def on_event(event: Event) -> None:
            nonlocal ended
            if not ended:
                if isinstance(event, Started):
                    span.set_attribute("k3wb.conversation", event.conversation)
                    span.set_attribute("k3wb.cached_tokens", event.cached_tokens)
                elif isinstance(event, Finished):
                    for key, value in _response_attributes(event, self.model, self.trace_root).items():
                        span.set_attribute(key, value)
                    span.end()
                    ended = True
                elif isinstance(event, Failed):
                    span.set_attribute("error.type", str(event.status))
                    span.set_status(Status(StatusCode.ERROR, event.message[:500]))
                    span.end()
                    ended = True
            emit(event)

        return on_event

    def shutdown(self) -> None:
        self.provider.shutdown()


def _request_attributes(request: Any, model: str) -> dict[str, Any]:
    out: dict[str, Any] = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": SYSTEM, "gen_ai.system": SYSTEM,
                           "gen_ai.request.model": model, "gen_ai.request.max_tokens": int(request.max_tokens),
                           "gen_ai.request.temperature": float(request.temperature),
                           "gen_ai.request.top_p": float(request.top_p),
                           "k3wb.stream": bool(request.stream)}
    if request.seed is not None:
        out["gen_ai.request.seed"] = int(request.seed)
    if request.stop:
        out["gen_ai.request.stop_sequences"] = list(request.stop)
    return out


def _response_attributes(done: Finished, model: str, trace_root: Path | None) -> dict[str, Any]:
    out: dict[str, Any] = {"gen_ai.response.model": model, "gen_ai.response.finish_reasons": [done.finish_reason],
                           "gen_ai.usage.input_tokens": done.prompt_tokens,
                           "gen_ai.usage.output_tokens": done.completion_tokens, "k3wb.turn": done.turn}
    if done.ttft_s is not None:
        out["k3wb.ttft_s"] = float(done.ttft_s)
    if done.trace:
        out["k3wb.trace"] = str(trace_root / done.trace) if trace_root is not None else done.trace
    return out


def make_telemetry(kind: str, *, model: str, trace_root: Path | None) -> RequestTelemetry | None:
    """`--otel`: None for `off`; a console or OTLP exporter otherwise (one line when a package is missing)."""
    if kind not in EXPORTERS:
        raise InputError(f"--otel must be one of {', '.join(EXPORTERS)}, got {kind!r:.40}")
    if kind == "off":
        return None
    try:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
    except ImportError:
        raise InputError("--otel needs the OpenTelemetry SDK: pip install opentelemetry-sdk") from None
    if kind == "console":
        return RequestTelemetry(ConsoleSpanExporter(), model=model, trace_root=trace_root)
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise InputError("--otel otlp needs the OTLP exporter: pip install opentelemetry-exporter-otlp-proto-http") \
            from None
    return RequestTelemetry(OTLPSpanExporter(), model=model, trace_root=trace_root)


__all__ = ["EXPORTERS", "RequestTelemetry", "make_telemetry"]
