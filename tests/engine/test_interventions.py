"""Interventions (engine.interventions): the spec, and what each op does to the reads, the KDA memory and
the routes, on every path (full forward, chunked prefill, eager, static and compiled decode steps)."""

from __future__ import annotations

import json

import pytest
import torch

from engine import load_model
from tests.helpers import NEAR_TIE, decode_logits, random_ids, topk_boundary_gap
from engine.decode import step as decode_step
from engine.decode.step import DecodeStep
from engine.errors import InputError
from engine.interventions import DsaHide, InterventionPlan, parse_interventions, to_json
from engine.layers import kda as kda_layer
from engine.ops.dsa.masked import masked_indexer_topk
from engine.ops.dsa.reference import _select, indexer_scores, indexer_topk
from engine.ops.kda.reference import kda_recurrent
from engine.ops.mla.masked import masked_attention_latent
from engine.ops.mla.reference import dense_attention_expanded, dense_attention_latent, sparse_attention_latent
from engine.session import Session

# tiny k3.1: layers 0 1 3 4 are KDA (2 heads), 2 and 5 DSA (top-k 16); 1-5 MoE (8 experts, 2 per token)
SPECS = {
    "dsa.hide": [{"op": "dsa.hide", "positions": [4, 20], "layers": "all"}],
    "dsa.pin": [{"op": "dsa.pin", "positions": [0, 6], "layers": [5]}],
    "kda.suppress_writes": [{"op": "kda.suppress_writes", "positions": [3, 19], "layers": [1, 3], "heads": [1]}],
    "kda.erase": [{"op": "kda.erase", "at": 21, "layers": "all", "heads": [0]}],
    "kda.scale": [{"op": "kda.scale", "at": 9, "factor": 0.25, "layers": [4]}],
    "kda.scale in decode": [{"op": "kda.scale", "at": 29, "factor": -0.5, "layers": [0, 3], "heads": [1]}],
    "moe.ban": [{"op": "moe.ban", "experts": [0, 3, 5], "layers": "all", "positions": [0, 40]}],
    "moe.force": [{"op": "moe.force", "experts": [6], "layers": [2, 4]}],
}
EVERY_OP = [entry for spec in SPECS.values() for entry in spec]


@pytest.fixture(scope="module")
def model():
    return load_model("preset:tiny:k3.1", seed=1)


def full_forward(model, ids: list[int], spec) -> torch.Tensor:
    items = parse_interventions(spec)
    model.runtime.interventions = InterventionPlan(items, model.config) if items else None
    try:
        with torch.inference_mode():
            return model(torch.tensor([ids]))[0]
    finally:
        model.runtime.interventions = None


def session_logits(model, ids: list[int], spec, prompt: int, mode: bool | str, chunk: int = 16) -> torch.Tensor:
    """Chunked prefill of `prompt` tokens under `spec`, then one decode step per remaining token."""
    return decode_logits(model, ids, prompt, mode, spec=spec, chunk=chunk)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())


# ---- the spec ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, message", [
    ('[{"op": "dsa.erase", "positions": [0, 4]}]', "unknown op 'dsa.erase'"),
    ('[{"op": "dsa.hide", "positions": [5, 2]}]', "START < END"),
    ('[{"op": "dsa.hide", "positions": [0, 4], "layers": [1]}]', "layer(s) [1] are not DSA layers"),
    ('[{"op": "kda.erase", "at": 3, "heads": [2]}]', "head(s) [2] do not exist"),
    ('[{"op": "moe.ban", "experts": [8]}]', "expert(s) [8] do not exist"),
    ('[{"op": "kda.erase", "at": 3, "heads": [-1]}]', "list of ids >= 0"),
    ('[{"op": "moe.force", "experts": [1, 2, 3]}]', "a token uses 2"),
    ('[{"op": "dsa.hide", "segment": "doc"}]', "\"segment\" must be resolved"),
    ('[{"op": "kda.scale", "at": 3}]', "missing ['factor']"),
    ('[{"op": "moe.ban", "experts": [1], "heads": [0]}]', "unknown key(s) ['heads']"),
    ('{"op": "moe.ban"}', "a JSON list"),
    ('[{"op": "dsa.hide", "positions": [0, 4]', "not valid JSON"),
])
def test_bad_specs_name_the_entry_and_change_nothing(model, spec, message):
    s = Session(model)
    s.append(ids=random_ids(8))
    with pytest.raises(InputError, match="intervention|JSON") as info:
        s.set_interventions(spec)
    assert message in str(info.value)
    assert s.interventions == () and s.intervention_log == []


def test_spec_round_trips_and_plans_are_data(model):
    items = parse_interventions(json.dumps(EVERY_OP))
    assert parse_interventions([to_json(i) for i in items]) == items
    assert parse_interventions([]) == ()
    plan = InterventionPlan(items, model.config)
    moved = InterventionPlan(parse_interventions([{**e, "positions": [1, 2]} if "positions" in e else e
                                                  for e in EVERY_OP]), model.config)
    assert plan.signature == moved.signature  # new positions: new data, the same compiled graph
    assert plan.dsa[2] is not None and plan.dsa[0] is None and plan.kda[2] is None and plan.moe[0] is None


# ---- DSA reads ----------------------------------------------------------------------------------------

def _by_hand(q, w, k, q_pos, topk, hidden, pinned=None):
    """Top-k of the full score matrix with hidden keys -inf and pinned keys +inf (a query keeps its own key)."""
    scores = indexer_scores(q, w, k)
    key_pos = torch.arange(k.shape[1])
    scores = scores.masked_fill(key_pos.view(1, -1) > q_pos.view(-1, 1), float("-inf"))
    before = key_pos.view(1, -1) < q_pos.view(-1, 1)
    if pinned is not None:
        scores = scores.masked_fill((key_pos >= pinned[0]) & (key_pos < pinned[1]) & (key_pos <= q_pos.view(-1, 1)),
                                    float("inf"))
    scores = scores.masked_fill((key_pos >= hidden[0]) & (key_pos < hidden[1]) & before, float("-inf"))
    vals, idx = _select(scores, key_pos, topk)
    idx = idx.masked_fill(vals == float("-inf"), -1)
    order = torch.where(idx < 0, k.shape[1], idx).argsort(-1)
    return idx.gather(-1, order)


@pytest.mark.parametrize("spec", [{"hide": (10, 30)}, {"hide": (2, 5), "pin": (40, 44)}, {"pin": (0, 24)}])
def test_indexer_selection_equals_hand_masked_scores(spec):
    torch.manual_seed(0)
    B, T, Hi, D, topk = 1, 64, 4, 16, 8
    q, w, k = torch.randn(B, T, Hi, D), torch.rand(B, T, Hi), torch.randn(B, T, D)
    pos = torch.arange(T)
    hidden, pinned = spec.get("hide", (0, 0)), spec.get("pin")
    from engine.interventions import DsaRule, _range_table
    rule = DsaRule(_range_table([hidden], "cpu") if "hide" in spec else None,
                   _range_table([pinned], "cpu") if pinned else None)
    want = _by_hand(q, w, k, pos, topk, hidden, pinned)
    # blocks and the whole matrix score in matmuls of other shapes: the same keys only without a near tie
    visible = indexer_scores(q, w, k).masked_fill(pos.view(1, -1) > pos.view(-1, 1), float("-inf"))
    assert topk_boundary_gap(visible, topk) > NEAR_TIE, "inputs put two keys in a near tie; change the seed"
    got, _ = indexer_topk(q, w, k, pos, topk, key_block=16, q_block=8, intervention=rule)
    assert torch.equal(got, want)
    static, _ = masked_indexer_topk(q, w, torch.cat((k, torch.randn(B, 8, D)), 1), pos, topk, intervention=rule)
    assert torch.equal(static, want)
    chosen = got[0]
    for t in range(T):
        sel = set(chosen[t][chosen[t] >= 0].tolist())
        assert not sel & (set(range(*hidden)) - {t})  # a hidden key is never read (a query keeps its own)
        if pinned:
            visible = [p for p in range(*pinned) if p <= t]
            assert set(visible[:topk]) <= sel  # pinned keys always read


def test_dense_attention_with_hidden_keys_equals_sparse_over_the_rest():
    """Dense reads mask the hidden keys: equal to attention over exactly the visible, unhidden keys."""
    from engine.interventions import DsaRule, _range_table
    torch.manual_seed(1)
    B, T, H, R, Dr, Dk, Dv = 1, 24, 2, 8, 4, 6, 5
    q_lat, q_rope = torch.randn(B, T, H, R), torch.randn(B, T, H, Dr)
    c, k_r = torch.randn(B, T, R), torch.randn(B, T, Dr)
    pos = torch.arange(T)
    rule = DsaRule(_range_table([(3, 11)], "cpu"), None)
    idx = torch.full((B, T, T), -1)
    for t in range(T):
        keys = [s for s in range(t + 1) if not (3 <= s < 11 and s < t)]
        idx[0, t, : len(keys)] = torch.tensor(keys)
    want = sparse_attention_latent(q_lat, q_rope, c, k_r, idx, 0.3)
    assert torch.allclose(dense_attention_latent(q_lat, q_rope, c, k_r, pos, 0.3, key_block=5, intervention=rule),
                          want, atol=1e-5)
    assert torch.allclose(masked_attention_latent(q_lat, q_rope, torch.cat((c, c[:, :4]), 1),
                                                  torch.cat((k_r, k_r[:, :4]), 1), pos, 0.3, intervention=rule),
                          want, atol=1e-5)
    # the expanded form: per-head keys [W_kb c, k_r] and values W_vb c
    w_kb, w_vb = torch.randn(H, Dk, R), torch.randn(H, Dv, R)
    q_nope = torch.randn(B, T, H, Dk)
    q = torch.cat((q_nope, q_rope), -1)
    k = torch.cat((torch.einsum("btr,hdr->bthd", c, w_kb), k_r.unsqueeze(2).expand(-1, -1, H, -1)), -1)
    v = torch.einsum("btr,hvr->bthv", c, w_vb)
    expanded = dense_attention_expanded(q, k, v, pos, 0.3, key_block=7, q_block=5, intervention=rule)
    q_abs = torch.einsum("bthd,hdr->bthr", q_nope, w_kb)
    want_v = torch.einsum("bthr,hvr->bthv", sparse_attention_latent(q_abs, q_rope, c, k_r, idx, 0.3), w_vb)
    assert torch.allclose(expanded, want_v, atol=1e-4)


def test_hidden_keys_are_never_selected_in_the_model(model):
    """Through a session: the `dsa.topk` probe never shows a hidden key (beyond a query's own)."""
    from engine.probes import probe_points
    seen = []
    points = [p for p in probe_points(model) if p.signal.name == "dsa.topk"]
    for p in points:
        p.attach(lambda emission: seen.append(emission.data))
    try:
        session_logits(model, random_ids(48, 3), SPECS["dsa.hide"], 40, "static")
        model.deliver_probes() if hasattr(model, "deliver_probes") else points[0].deliver()
    finally:
        for p in points:
            p.detach()
    assert seen
    for payload in seen:
        idx, positions = payload["indices"][0], payload["positions"]
        for row, t in zip(idx, positions.tolist()):
            assert not set(row.tolist()) & (set(range(4, 20)) - {t})


# ---- KDA memory ---------------------------------------------------------------------------------------

def _kda_inputs(model, ids, layer_order: int, monkeypatch):
    """(q, k, v, g, beta) the KDA core received at the `layer_order`-th KDA call of one full prefill."""
    calls = []
    real = kda_layer.kda_chunked

    def spy(q, k, v, g, beta, initial, **kw):
        calls.append((q, k, v, g, beta))
        return real(q, k, v, g, beta, initial, **kw)

    monkeypatch.setattr(kda_layer, "kda_chunked", spy)
    s = Session(model, prefill_chunk=len(ids))
    s.append(ids=ids)
    s.prefill()
    monkeypatch.setattr(kda_layer, "kda_chunked", real)
    return calls[layer_order], s


def test_suppressed_writes_equal_the_recurrence_with_beta_zero(model, monkeypatch):
    ids = random_ids(40, 5)
    # KDA layers 0 1 3 4: layer 1 (the first one suppressed, so its inputs are the plain run's)
    (q, k, v, g, beta), _ = _kda_inputs(model, ids, 1, monkeypatch)
    s = Session(model, prefill_chunk=40)
    s.set_interventions(SPECS["kda.suppress_writes"])  # layers 1 and 3, head 1, positions [3, 19)
    s.append(ids=ids)
    s.prefill()
    zeroed = beta.clone()
    zeroed[:, 3:19, 1] = 0.0
    _, want = kda_recurrent(q, k, v, g, zeroed)
    assert torch.allclose(s.state.layers[1].recurrent, want, atol=1e-5, rtol=1e-4)
    _, untouched = kda_recurrent(q, k, v, g, beta)
    assert not torch.allclose(want, untouched, atol=1e-4)


@pytest.mark.parametrize("op", ["kda.erase", "kda.scale", "kda.scale in decode"])
def test_state_edits_equal_a_hand_edit(model, op):
    spec = SPECS[op]
    at, factor = spec[0]["at"], spec[0].get("factor", 0.0)
    heads = spec[0].get("heads", [0, 1])
    layers = [0, 1, 3, 4] if spec[0]["layers"] == "all" else spec[0]["layers"]
    ids = random_ids(36, 7)
    by_hand = Session(model, prefill_chunk=at + 1)
    by_hand.append(ids=ids[: at + 1])
    by_hand.prefill()
    for layer in layers:
        state = by_hand.state.layers[layer]
        state.recurrent = state.recurrent.clone()
        state.recurrent[:, heads] *= factor
    want = by_hand.feed(ids[at + 1:])
    edited = Session(model, prefill_chunk=16)  # the edit falls inside a chunk
    edited.set_interventions(spec)
    edited.append(ids=ids)
    got = edited.prefill(return_logits=True)[at + 1:]
    assert rel_err(got, want) < 1e-4
    # set after `at` was consumed: applied once, to the state as it is then
    late = Session(model, prefill_chunk=at + 1)
    late.append(ids=ids[: at + 1])
    late.prefill()
    late.set_interventions(spec)
    assert late.intervention_log[0]["applied_at"] == at
    assert rel_err(late.feed(ids[at + 1:]), want) < 1e-4


# ---- expert routes ------------------------------------------------------------------------------------

def test_banned_experts_are_never_routed_and_forced_ones_always(model):
    routes: dict[int, list[torch.Tensor]] = {}
    hooks = [model.model.layers[i].block_sparse_moe.gate.register_forward_hook(
        lambda mod, args, out, i=i: routes.setdefault(i, []).append(out[1])) for i in range(1, 6)]
    try:
        session_logits(model, random_ids(50, 8), SPECS["moe.ban"] + SPECS["moe.force"], 44, "static")
    finally:
        for h in hooks:
            h.remove()
    for layer, calls in routes.items():
        ids = torch.cat([c.reshape(-1, 2) for c in calls])  # 50 positions in order
        assert ids.shape[0] == 50
        assert not torch.isin(ids[:40], torch.tensor([0, 3, 5])).any()  # banned over [0, 40)
        if layer in (2, 4):
            assert (ids == 6).any(-1).all()  # forced everywhere
    later = torch.cat([c.reshape(-1, 2) for c in routes[1]])[40:]
    assert torch.isin(later, torch.tensor([0, 3, 5])).any()  # after the range they route again


# ---- every path agrees -------------------------------------------------------------------------------

def test_no_intervention_is_bit_identical(model):
    ids = random_ids(40, 9)
    plain = session_logits(model, ids, [], 32, False)
    unreached = [{"op": "dsa.hide", "positions": [500, 600]}, {"op": "kda.suppress_writes", "positions": [500, 600]},
                 {"op": "moe.ban", "experts": [1], "positions": [500, 600]}, {"op": "kda.erase", "at": 700}]
    assert torch.equal(session_logits(model, ids, unreached, 32, False), plain)
    assert torch.equal(session_logits(model, ids, [], 32, False), plain)
    assert model.runtime.interventions is None  # never left on the shared model


@pytest.mark.parametrize("name", list(SPECS))
def test_chunked_prefill_and_decode_steps_equal_the_full_forward(model, name):
    ids = random_ids(40, 10)
    full = full_forward(model, ids, SPECS[name])
    plain = full_forward(model, ids, [])
    assert rel_err(full, plain) > 1e-4  # the intervention changes the logits
    for mode in (False, "static"):
        assert rel_err(session_logits(model, ids, SPECS[name], 24, mode), full) < 5e-5, mode


def test_compiled_decode_equals_eager_under_every_op_with_one_graph(model, monkeypatch):
    monkeypatch.setattr(decode_step, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    if hasattr(model, "_decode_step"):
        del model._decode_step
    ids = random_ids(40, 11)
    eager = session_logits(model, ids, EVERY_OP, 30, False)
    compiled = session_logits(model, ids, EVERY_OP, 30, True)
    assert rel_err(compiled, eager) < 5e-5
    step = DecodeStep.of(model)
    compiles = step.compiles
    moved = [{**e, "positions": [2, 33]} if "positions" in e else e for e in EVERY_OP]
    moved = [{**e, "at": 31} if "at" in e else e for e in moved]
    assert rel_err(session_logits(model, ids, moved, 30, True), session_logits(model, ids, moved, 30, False)) < 5e-5
    assert step.compiles == compiles  # new positions and edits: the same graph
    del model._decode_step
    torch._dynamo.reset()


def test_snapshot_and_fork_record_the_interventions(model, tmp_path):
    s = Session(model, prefill_chunk=16)
    s.append(ids=random_ids(20, 12))
    s.set_interventions([DsaHide((2, 6))])
    s.prefill()
    s.set_interventions([])
    s.append(ids=random_ids(4, 13))
    s.prefill()
    assert s.intervention_log == [{"op": "dsa.hide", "positions": [2, 6], "layers": "all", "from": 0, "to": 20}]
    s.save(tmp_path / "snap")
    snapshot = json.loads((tmp_path / "snap" / "snapshot.json").read_text())
    assert snapshot["interventions"] == s.intervention_log
    assert s.fork().intervention_log == s.intervention_log


def test_dense_reads_hide_the_range_on_every_path(model):
    """With every DSA layer reading densely, a hidden range is masked out of the attention itself."""
    ids = random_ids(40, 14)
    model.runtime.dsa_force_dense = True
    try:
        full = full_forward(model, ids, SPECS["dsa.hide"])
        assert rel_err(full, full_forward(model, ids, [])) > 1e-4
        for mode in (False, "static"):
            assert rel_err(session_logits(model, ids, SPECS["dsa.hide"], 24, mode), full) < 5e-5, mode
    finally:
        model.runtime.dsa_force_dense = False
