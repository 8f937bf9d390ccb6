"""`workbench conformance` finds and localises faults injected into a served model FROM THIS TEST CODE
(wrapping the served model's objects; the product has no fault switch): a KDA state layout error at a
prefill chunk boundary, a wrong prefix restore, bf16-rounded decay, a NaN state, one layer's weights
perturbed. Each names the layer and the position. The reference is a second, untouched copy of the model.

`python -m tests.workbench.test_conformance_faults` prints the table of faults (found, layer, position,
seconds) that docs/conformance.md quotes.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest
import torch

from apps.serve.app import AppConfig
from apps.serve.server import Server
from apps.serve.worker import ServeOptions
from apps.web_guard import HostPolicy
from workbench.conformance import ConformanceReport, SuiteItem, conformance
from workbench.sessions import load_with_tokenizer, open_session

MODEL = "preset:tiny"
CHUNK = 64        # the served prefill chunk: small, so short prompts cross its boundaries
KDA_LAYER = 1     # a KDA layer with MoE routes of its own (layer 0 is dense: its faults show in layer 1)
PROMPT = "a needle waits in the hay while the fox jumps over the dog"  # about 80 tokens rendered


def _serve(model: Any, tokenizer: Any) -> Server:
    srv = Server(model, tokenizer, ServeOptions(model_name=MODEL, trace_root=None, max_queue=4, prefill_chunk=CHUNK),
                 AppConfig(model_id=MODEL, hosts=HostPolicy.for_server("127.0.0.1"), max_body_bytes=4 << 20,
                           max_tokens=4096), port=0)
    srv.start_in_thread()
    return srv


def _after_call(attn: Any, change: Callable[[Any, int, int], None]) -> None:
    """Wrap a KDA layer's forward so `change(state, start, count)` runs on its state after each prefill call."""
    original = attn.forward

    def forward(x: torch.Tensor, state: Any = None, start: Any = 0, key_start: Any = None) -> torch.Tensor:
        out = original(x, state, start, key_start)
        if state is not None and x.shape[1] > 1 and not isinstance(start, torch.Tensor):
            change(state, int(start), int(x.shape[1]))
        return out

    attn.forward = forward


def state_layout_error(model: Any, server: Server) -> None:
    """(a) heads swapped in the carried state when a prefill chunk ends on a chunk boundary."""
    def swap(state: Any, start: int, count: int) -> None:
        if (start + count) % CHUNK == 0:
            state.recurrent = state.recurrent.flip(1)
    _after_call(model.model.layers[KDA_LAYER].self_attn, swap)


def nan_state(model: Any, server: Server) -> None:
    """(d) one head of the carried state becomes NaN at the first chunk boundary."""
    def poison(state: Any, start: int, count: int) -> None:
        if start + count == CHUNK:
            state.recurrent = state.recurrent.clone()
            state.recurrent[:, 0] = float("nan")
    _after_call(model.model.layers[KDA_LAYER].self_attn, poison)


def bf16_decay(model: Any, server: Server) -> None:
    """(c) decay exp(g) that bf16 rounds to 1.0 (above 1 - 2**-9) becomes exactly 1.0: channels never forget."""
    attn = model.model.layers[KDA_LAYER].self_attn
    original = attn.decay

    def decay(x: torch.Tensor, f_a: torch.Tensor | None = None) -> torch.Tensor:
        g = original(x, f_a)
        return g.masked_fill(g.exp() > 1 - 2 ** -9, 0.0)

    attn.decay = decay


def wrong_restore(model: Any, server: Server) -> None:
    """(b) the prefix cache restores the KDA states of a shorter prefix than the conversation it names."""
    cache = server.worker.cache
    original = cache.take

    def take(chat: Any, owner: str = "") -> Any:
        conv = original(chat, owner)
        if conv is not None:
            shorter = open_session(model, server.worker.tokenizer, prefill_chunk=CHUNK, progress=False,
                                   model_name=MODEL)
            shorter.append(ids=conv.session.tokens[: conv.session.length // 2])
            shorter.prefill()
            for mine, theirs in zip(conv.session.state.layers, shorter.state.layers):
                if hasattr(mine, "recurrent"):
                    mine.recurrent, mine.conv = theirs.recurrent, theirs.conv
        return conv

    cache.take = take


def perturbed_weights(model: Any, server: Server) -> None:
    """(e) one MLA layer's output projection off by 20%."""
    with torch.no_grad():
        model.model.layers[model.config.mla_layers[0]].self_attn.o_proj.weight.mul_(1.2)


FAULTS: dict[str, tuple[Callable[[Any, Server], None], list[Any]]] = {
    "KDA state layout at a chunk boundary": (state_layout_error, [PROMPT]),
    "wrong prefix restore": (wrong_restore, [PROMPT, SuiteItem("and then?", "follow-up", 0)]),
    # a channel that never forgets drifts slowly: its routes flip after a few hundred tokens (about 530 here)
    "bf16-rounded decay": (bf16_decay, [" ".join([PROMPT] * 8)]),
    "NaN state": (nan_state, [PROMPT]),
    "one layer's weights perturbed": (perturbed_weights, [PROMPT]),
}


def run_fault(name: str, reference: tuple[Any, Any]) -> tuple[ConformanceReport, float]:
    inject, prompts = FAULTS[name]
    served_model, served_tokenizer = load_with_tokenizer(MODEL, seed=0)
    srv = _serve(served_model, served_tokenizer)
    inject(served_model, srv)
    started = time.perf_counter()
    try:
        report = conformance(srv.url, *reference, prompts, model_id=MODEL, max_tokens=4)
    finally:
        srv.stop()
    return report, time.perf_counter() - started


@pytest.fixture(scope="module")
def reference():
    return load_with_tokenizer(MODEL, seed=0)


def test_a_kda_state_layout_error_at_a_chunk_boundary_is_named(reference) -> None:
    report, _ = run_fault("KDA state layout at a chunk boundary", reference)
    assert report.verdict == "diverges", report.to_json()
    # the swapped state is first read by the next chunk's first token, in the faulty layer
    assert report.first_divergent_layer == KDA_LAYER and report.first_divergent_position == CHUNK, report.to_json()


def test_a_wrong_prefix_restore_is_named_at_the_restored_length(reference) -> None:
    report, _ = run_fault("wrong prefix restore", reference)
    first, follow = report.prompts
    assert first.verdict == "conforms" and follow.cached_tokens, report.to_json()
    assert report.verdict == "diverges" and follow.verdict == "diverges", report.to_json()
    assert report.first_divergent_position == follow.cached_tokens  # the first position the restored state computes
    assert report.first_divergent_layer == KDA_LAYER, report.to_json()  # layer 0 (dense) shows in layer 1's routes


def test_bf16_rounded_decay_is_named(reference) -> None:
    report, _ = run_fault("bf16-rounded decay", reference)
    assert report.verdict == "diverges" and report.first_divergent_layer == KDA_LAYER, report.to_json()
    assert report.first_divergent_position is not None  # the earliest row of any layer (a later layer flips first)


def test_a_nan_state_is_a_divergence_at_its_layer_and_position(reference) -> None:
    report, _ = run_fault("NaN state", reference)
    assert report.verdict == "diverges", report.to_json()
    assert report.first_divergent_layer == KDA_LAYER and report.first_divergent_position == CHUNK, report.to_json()
    assert f"the state layer(s) {KDA_LAYER} carried into it hold NaN/inf" in report.prompts[0].detail  # that one only


def test_one_perturbed_layer_is_named(reference) -> None:
    report, _ = run_fault("one layer's weights perturbed", reference)
    layer = reference[0].config.mla_layers[0]
    assert report.verdict == "diverges" and report.first_divergent_layer == layer, report.to_json()


if __name__ == "__main__":
    ref = load_with_tokenizer(MODEL, seed=0)
    print("| fault | found | layer | position | seconds |\n| --- | --- | --- | --- | --- |")
    for fault in FAULTS:
        rep, seconds = run_fault(fault, ref)
        print(f"| {fault} | {'yes' if rep.verdict == 'diverges' else 'NO: ' + rep.verdict} | "
              f"{rep.first_divergent_layer} | {rep.first_divergent_position} | {seconds:.1f} |")
