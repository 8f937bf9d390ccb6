"""`workbench conformance` against `workbench serve`: a clean server conforms on the suite (long contexts,
a restored prefix, repeats, concurrent requests); a perturbed layer (a fault injected from test code)
diverges and the CLI names it in OUT.json, the Parquet table and the deployment record; serve's capture
fields are the ones `workbench import` reads. The other injected faults: test_conformance_faults.py."""

from __future__ import annotations

import base64
import json
import urllib.request

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from apps.cli import main
from apps.serve.app import AppConfig
from apps.serve.server import Server
from apps.serve.worker import ServeOptions
from apps.web_guard import HostPolicy
from workbench.captures.records import parse_vllm
from workbench.conformance import conformance, long_context_suite
from workbench.sessions import load_with_tokenizer

MODEL = "preset:tiny"


def serve(model, tokenizer) -> Server:
    srv = Server(model, tokenizer, ServeOptions(model_name=MODEL, trace_root=None, max_queue=4),
                 AppConfig(model_id=MODEL, hosts=HostPolicy.for_server("127.0.0.1"), max_body_bytes=4 << 20,
                           max_tokens=4096), port=0)
    srv.start_in_thread()
    return srv


@pytest.fixture(scope="module")
def reference():
    return load_with_tokenizer(MODEL, seed=0)


def test_a_clean_server_conforms_on_the_long_context_suite(reference) -> None:
    model, tokenizer = reference
    served_model, served_tokenizer = load_with_tokenizer(MODEL, seed=0)
    srv = serve(served_model, served_tokenizer)
    try:
        report = conformance(srv.url, model, tokenizer, long_context_suite(tokenizer, lengths=(100, 509)),
                             model_id=MODEL, max_tokens=6)
    finally:
        srv.stop()
    assert report.verdict == "conforms", report.to_json()
    assert all(r.generated == 6 and r.max_logprob_diff < 1e-3 for r in report.prompts), report.to_json()
    assert [r.kind for r in report.prompts] == ["single", "single", "follow-up", "repeat", "concurrent", "concurrent"]
    follow = report.prompts[2]  # restored the first prompt and its reply: an odd length, all but the last token
    assert follow.cached_tokens == report.prompts[0].prompt_tokens + 6 - 1 and "restore" not in follow.detail
    assert all(r.compared_rows > 0 for r in report.prompts) and report.first_divergent_layer is None


def test_one_perturbed_layer_diverges_and_the_cli_writes_json_parquet_and_the_deployment_record(
        reference, tmp_path, capsys) -> None:
    model, tokenizer = reference
    served_model, served_tokenizer = load_with_tokenizer(MODEL, seed=0)
    layer = served_model.config.mla_layers[0]
    with torch.no_grad():  # the fault: one MLA layer's output projection off by 20%
        served_model.model.layers[layer].self_attn.o_proj.weight.mul_(1.2)
    srv = serve(served_model, served_tokenizer)
    try:
        prompts = tmp_path / "prompts.json"
        prompts.write_text(json.dumps(["a first prompt for the check", [{"role": "user", "content": "second"}]]))
        code = main(["conformance", "--endpoint", srv.url, "--model", MODEL, "--prompts", str(prompts),
                     "--max-tokens", "4", "--json", str(tmp_path / "out.json")])
    finally:
        srv.stop()
    out = capsys.readouterr().out
    assert code == 1 and "verdict: diverges: the endpoint does not compute the model" in out, out
    report = json.loads((tmp_path / "out.json").read_text())
    first = report["prompts"][0]
    assert report["verdict"] == "diverges" and report["first_divergent_layer"] == layer, report
    assert report["first_divergent_position"] == first["first_divergent_position"] is not None
    assert first["max_logprob_diff"] > 0.1 and f"lowest divergent layer {layer}" in first["detail"]
    table = pq.read_table(tmp_path / "out.parquet")  # self-describing: verdict and column docs in the metadata
    meta = table.schema.metadata
    assert meta[b"k3wb.conformance.verdict"] == b"diverges" and b"k3wb.column.first_divergent_layer" in meta
    assert table.column("first_divergent_layer").to_pylist()[0] == layer
    line = json.loads((tmp_path / "deployment-record.jsonl").read_text().splitlines()[-1])
    assert line["kind"] == "conformance" and line["verdict"] == "diverges" and line["first_divergent_layer"] == layer
    assert line["endpoint"] == srv.url and line["prompts"] == 2 and line["max_logprob_diff"] > 0.1 and line["date"]


def test_serve_returns_captures_in_vllm_and_sglang_fields(reference) -> None:
    """The fields `workbench import` reads: vLLM's .npy routes split at the prompt, SGLang's flat arrays."""
    model, tokenizer = reference
    srv = serve(*load_with_tokenizer(MODEL, seed=0))
    try:
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello " * 30}], "max_tokens": 3,
                           "temperature": 0, "return_routed_experts": True, "return_indexer_topk": True,
                           "return_token_ids": True}).encode()
        request = urllib.request.Request(srv.url + "/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(request, timeout=120).read())
        later = json.loads(urllib.request.urlopen(urllib.request.Request(
            srv.url + "/chat/completions", data=json.dumps({**json.loads(body), "routed_experts_start_len": 5}).encode(),
            headers={"Content-Type": "application/json"}), timeout=120).read())
        streamed = urllib.request.Request(srv.url + "/chat/completions", data=json.dumps(
            {**json.loads(body), "stream": True}).encode(), headers={"Content-Type": "application/json"})
        events = [json.loads(line[6:]) for line in urllib.request.urlopen(streamed, timeout=120).read().decode()
                  .splitlines() if line.startswith("data: {")]
    finally:
        srv.stop()
    assert later["choices"][0]["sgl_ext"]["routed_experts_start_len"] == 5  # SGLang's request field honoured
    later_routes = base64.b64decode(later["choices"][0]["sgl_ext"]["routed_experts"])
    assert later_routes == base64.b64decode(reply["choices"][0]["sgl_ext"]["routed_experts"])[5 * len(later_routes) // (
        len(later["prompt_token_ids"]) + len(later["choices"][0]["token_ids"]) - 1 - 5):]
    last = next(e for e in events if e["choices"] and e["choices"][0]["finish_reason"])  # the fields ride on it
    assert last["prompt_token_ids"] == reply["prompt_token_ids"] and last["choices"][0]["token_ids"] == \
        reply["choices"][0]["token_ids"] and last["choices"][0]["routed_experts"] == reply["choices"][0]["routed_experts"]
    record = parse_vllm(1, reply, model.config)  # the importer's own reader
    n, total = len(record.prompt), record.total
    assert [(a.rows, end) for a, end in record.routes] == [(n, n), (total - 1 - n, total - 1)]
    ext = reply["choices"][0]["sgl_ext"]
    config = model.config
    routes = np.frombuffer(base64.b64decode(ext["routed_experts"]), "<i4").reshape(total - 1, config.num_hidden_layers, -1)
    assert ext["routed_experts_start_len"] == 0 and routes.shape[-1] == config.num_experts_per_token
    topk = np.frombuffer(base64.b64decode(ext["indexer_topk"]), "<i4").reshape(total - 1, config.num_hidden_layers, -1)
    dsa = list(config.dsa.layers)
    assert (topk[:, dsa] < np.arange(1, total)[:, None, None]).all()  # causal: a key at or before its query
    assert (topk[:, [i for i in range(config.num_hidden_layers) if i not in dsa]] == -1).all()


def test_an_endpoint_that_refuses_is_an_error_not_a_divergence(reference, capsys) -> None:
    code = main(["conformance", "--endpoint", "http://127.0.0.1:9/v1", "--model", MODEL, "--max-tokens", "2",
                 "--timeout", "5"])
    out = capsys.readouterr().out
    assert code == 1 and "verdict: error: the endpoint failed or refused" in out, out
    assert "  0 single     error " in out and "Connection refused" in out, out
