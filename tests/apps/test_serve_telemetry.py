"""`workbench serve --otel`: one OpenTelemetry span per request, GenAI attributes, linked to its trace."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import StatusCode  # noqa: E402

from apps.cli import main  # noqa: E402
from apps.serve.app import AppConfig  # noqa: E402
from apps.serve.server import Server  # noqa: E402
from apps.serve.telemetry import RequestTelemetry  # noqa: E402
from apps.serve.worker import ServeOptions  # noqa: E402
from apps.web_guard import HostPolicy  # noqa: E402
from workbench.sessions import load_with_tokenizer  # noqa: E402

MODEL = "preset:tiny"


def test_each_request_is_a_span_with_genai_attributes_and_its_trace(tmp_path) -> None:
    exporter = InMemorySpanExporter()
    telemetry = RequestTelemetry(exporter, model=MODEL, trace_root=tmp_path, batch=False)
    model, tokenizer = load_with_tokenizer(MODEL, seed=1)
    srv = Server(model, tokenizer, ServeOptions(model_name=MODEL, trace_root=tmp_path, max_queue=2, telemetry=telemetry),
                 AppConfig(model_id=MODEL, hosts=HostPolicy.for_server("127.0.0.1"), max_body_bytes=1 << 20,
                           max_tokens=4096), port=0)
    srv.start_in_thread()
    try:
        ok = httpx.post(f"{srv.url}/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 3, "temperature": 0, "seed": 7,
            "messages": [{"role": "user", "content": "a span for this request"}]})
        refused = httpx.post(f"{srv.url}/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "nothing to continue"}],
            "continue_final_message": True, "add_generation_prompt": False})
    finally:
        srv.stop()
        telemetry.shutdown()
    assert ok.status_code == 200 and refused.status_code == 400
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == [f"chat {MODEL}"] * 2
    done, failed = spans
    a = done.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 3 and a["gen_ai.request.seed"] == 7
    body = ok.json()
    assert a["gen_ai.response.id"] == body["id"]
    assert a["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"]
    assert a["k3wb.trace"] == str(tmp_path / body["k3"]["trace"]) and a["k3wb.conversation"] == body["k3"]["conversation"]
    assert done.end_time > done.start_time and a["k3wb.ttft_s"] > 0
    assert failed.status.status_code == StatusCode.ERROR and "last message from the assistant" in failed.status.description


def test_otel_flag_is_checked_at_start(capsys) -> None:
    with pytest.raises(SystemExit) as refused:  # argparse's usage error, before anything loads
        main(["serve", "--model", MODEL, "--otel", "jaeger"])
    assert refused.value.code == 2 and "--otel" in capsys.readouterr().err
