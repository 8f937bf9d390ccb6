"""`workbench conformance` against `workbench serve`: a clean server conforms; a served model with one
layer's weights perturbed (a fault injected from test code) diverges, at the first generated token."""

from __future__ import annotations

import json

import pytest
import torch

from apps.cli import main
from apps.serve.app import AppConfig
from apps.serve.server import Server
from apps.serve.worker import ServeOptions
from apps.web_guard import HostPolicy
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
    assert all(r.generated == 6 and r.max_logprob_diff < 1e-3 for r in report.prompts)


def test_one_perturbed_layer_diverges_and_says_where(reference, tmp_path, capsys) -> None:
    model, tokenizer = reference
    served_model, served_tokenizer = load_with_tokenizer(MODEL, seed=0)
    with torch.no_grad():  # the fault: one MLA layer's output projection off by 20%
        layer = served_model.config.mla_layers[0]
        weight = served_model.model.layers[layer].self_attn.o_proj.weight
        weight.mul_(1.2)
    srv = serve(served_model, served_tokenizer)
    try:
        prompts = tmp_path / "prompts.json"
        prompts.write_text(json.dumps(["a first prompt for the check", [{"role": "user", "content": "second"}]]))
        code = main(["conformance", "--endpoint", srv.url, "--model", MODEL, "--prompts", str(prompts),
                     "--max-tokens", "4", "--json", str(tmp_path / "out.json")])
    finally:
        srv.stop()
    out = capsys.readouterr().out
    assert code == 1 and "verdict: diverges at generated token" in out, out
    report = json.loads((tmp_path / "out.json").read_text())
    first = report["prompts"][0]
    assert report["verdict"] == "diverges" and report["first_divergent_position"] == first["first_divergent_position"]
    assert first["max_logprob_diff"] > 0.1 and f"token {first['first_divergent_position']} (" in first["detail"]


def test_an_endpoint_that_refuses_is_an_error_not_a_divergence(reference, capsys) -> None:
    code = main(["conformance", "--endpoint", "http://127.0.0.1:9/v1", "--model", MODEL, "--max-tokens", "2",
                 "--timeout", "5"])
    out = capsys.readouterr().out
    assert code == 1 and "verdict: error" in out and "prompt 0: error" in out, out
