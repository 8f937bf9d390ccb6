"""Recording is exact: what the trace says each layer selected, routed or remembered is recomputed
here, independently, from the checkpoint's tensors (read with safetensors, float64 maths) and the
layer inputs captured during the same session."""

from __future__ import annotations

import os
import time

import dataclasses
import json
from collections import defaultdict

import numpy as np
import pytest
import torch
from safetensors import safe_open

import workbench
from engine import load_model
from engine.decode import step as decode_step
from engine.probes import probe_points
from engine.session import Session
from engine.tokenizer import Tokenizer
from workbench.analysis import effective_rank
from workbench.recorders.policy import ALL

CONTEXT, NEW_TOKENS, CHUNK = 83, 6, 24  # tiny top-k is 16: the context is ~5x it


def checkpoint_tensor(ckpt, name: str) -> torch.Tensor:
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(ckpt / weight_map[name]), "pt") as f:
        return f.get_tensor(name).double()


@pytest.fixture(scope="module")
def recorded(checkpoint_dir, tmp_path_factory):
    """One recorded session (policy `all`) plus the inputs each DSA / MoE / KDA layer saw."""
    ckpt = checkpoint_dir("tiny", "k3.1", seed=7, dtype=torch.float32)
    model = load_model(ckpt)
    inputs: dict[int, list[torch.Tensor]] = defaultdict(list)
    hooks = []
    for i, layer in enumerate(model.model.layers):
        target = layer.self_attn if model.config.layer_kind(i) != "mla" else None
        for module in (target, getattr(layer, "block_sparse_moe", None)):
            if module is not None:
                key = i if module is target else 100 + i
                hooks.append(module.register_forward_pre_hook(
                    lambda m, args, key=key: inputs[key].append(args[0].detach().double()[0])))
    session = Session(model, Tokenizer.byte_level(), prefill_chunk=CHUNK)
    ids = torch.randint(0, 256, (CONTEXT,), generator=torch.Generator().manual_seed(3)).tolist()
    trace_dir = tmp_path_factory.mktemp("trace") / "t"
    # policy `all`, with the effective rank at every measured boundary (its own sampling is every 256 tokens)
    policy = dataclasses.replace(ALL, kda_rank_every=1)
    with workbench.record(session, trace=trace_dir, policy=policy):
        session.append(ids=ids, name="context")
        generated = [t.id for t in session.generate(NEW_TOKENS, temperature=0, stop_ids=())]
    for h in hooks:
        h.remove()
    assert all(p.sink is None for p in probe_points(model)), "record() must detach every sink"
    layer_inputs = {k: torch.cat(v) for k, v in inputs.items()}  # positions 0.. in call order
    return model, ckpt, workbench.open_trace(trace_dir), layer_inputs, len(ids) + len(generated) - 1


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def test_trace_is_complete_and_tagged(recorded):
    model, _, trace, _, n = recorded
    assert trace.status == "complete"
    assert len(trace.tokens()) == n + 1
    topk = trace.df("dsa_topk")
    assert sorted(topk["layer"].unique()) == [i for i in range(6) if model.config.is_dsa_layer(i)]
    assert sorted(topk["position"].unique()) == list(range(n))  # policy `all`: every query, once per layer
    assert (topk.groupby("layer").size() == n).all()
    assert topk["step"].nunique() > 1 and (topk["rank"] == 0).all()


def test_recorded_topk_equals_independent_indexer(recorded):
    model, ckpt, trace, inputs, n = recorded
    cfg = model.config
    topk = trace.df("dsa_topk")
    compared = 0
    for layer in [i for i in range(cfg.num_hidden_layers) if cfg.is_dsa_layer(i)]:
        p = f"language_model.model.layers.{layer}.self_attn."
        x = inputs[layer][:n]  # [T, hidden]
        q_resid = rms(x @ checkpoint_tensor(ckpt, p + "q_a_proj.weight").T,
                      checkpoint_tensor(ckpt, p + "q_a_layernorm.weight"), 1e-6)
        heads, dim, k = cfg.dsa.n_heads, cfg.dsa.head_dim, cfg.dsa.topk
        q = (q_resid @ checkpoint_tensor(ckpt, p + "indexer.wq_b.weight").T).view(n, heads, dim)
        keys = torch.nn.functional.layer_norm(x @ checkpoint_tensor(ckpt, p + "indexer.wk.weight").T, (dim,),
                                              checkpoint_tensor(ckpt, p + "indexer.k_norm.weight"),
                                              checkpoint_tensor(ckpt, p + "indexer.k_norm.bias"), 1e-6)
        w = x @ checkpoint_tensor(ckpt, p + "indexer.weights_proj.weight").T * heads ** -0.5
        scores = torch.einsum("thd,sd->ths", q, keys).div(dim ** 0.5).relu().mul(w[..., None]).sum(1)  # [T, S]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        rows = topk[topk["layer"] == layer].set_index("position")
        for t in range(n):
            got = set(rows.loc[t, "selected"].tolist())
            if t < k:
                assert got == set(range(t + 1))
                continue
            ordered = scores[t].sort(descending=True).values
            if (ordered[k - 1] - ordered[k]).abs() < 1e-6 * ordered[k - 1].abs().clamp_min(1e-3):
                continue  # a tie at the boundary: either choice is right
            assert got == set(scores[t].topk(k).indices.tolist()), f"layer {layer} query {t}"
            compared += 1
    assert compared > 50


def test_recorded_routes_equal_independent_router(recorded):
    model, ckpt, trace, inputs, n = recorded
    cfg = model.config
    routes = trace.df("moe_routes")
    compared = 0
    for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        p = f"language_model.model.layers.{layer}.block_sparse_moe.gate."
        x = inputs[100 + layer][:n]
        s = torch.sigmoid(x @ checkpoint_tensor(ckpt, p + "weight").T)
        choice = s + checkpoint_tensor(ckpt, p + "e_score_correction_bias")
        rows = routes[routes["layer"] == layer].set_index("position")
        assert len(rows) == n
        for t in range(n):
            ordered = choice[t].sort(descending=True)
            k = cfg.num_experts_per_token
            if ordered.values[k - 1] - ordered.values[k] < 1e-9:
                continue
            assert set(rows.loc[t, "experts"].tolist()) == set(ordered.indices[:k].tolist())
            expected_w = s[t, ordered.indices[:k]] / s[t, ordered.indices[:k]].sum() * cfg.routed_scaling_factor
            got_w = dict(zip(rows.loc[t, "experts"].tolist(), rows.loc[t, "weights"].tolist()))
            for e, wv in zip(ordered.indices[:k].tolist(), expected_w.tolist()):
                assert abs(got_w[e] - wv) < 2e-3  # stored as fp16
            compared += 1
    assert compared > 100
    counts = trace.df("moe_counts")
    per_layer = counts.groupby("layer")["count"].sum()
    assert (per_layer == n * cfg.num_experts_per_token).all()


def test_aggregates_agree_with_full_lists(recorded):
    _, _, trace, _, _ = recorded
    topk = trace.df("dsa_topk")
    counts = trace.df("dsa_key_counts").groupby("layer")["count"].sum()
    hist = trace.df("dsa_distance_hist").groupby("layer")["count"].sum()
    for layer, rows in topk.groupby("layer"):
        selections = int(sum(len(s) for s in rows["selected"]))
        assert counts[layer] == selections == hist[layer]
    sink = trace.df("dsa_sink").groupby("layer")[["queries", "sink_hits"]].sum()
    assert (sink["queries"] == topk.groupby("layer").size()).all()
    assert (sink["sink_hits"] <= sink["queries"]).all()
    mass = trace.df("dsa_dense_mass")["mass"]
    assert len(mass) and ((mass > 0) & (mass <= 1 + 1e-5)).all()


def test_recording_off_costs_nothing_and_default_policy_is_bounded(recorded, tmp_path):
    model = recorded[0]
    assert all(p.sink is None for p in probe_points(model))
    session = Session(model, Tokenizer.byte_level(), prefill_chunk=CHUNK)
    with workbench.record(session, trace=tmp_path / "d", policy={"dsa_prefill_stride": 32, "moe_window_every": 0}):
        session.append(ids=list(range(90)))
        session.prefill()
    trace = workbench.open_trace(tmp_path / "d")
    positions = trace.df("dsa_topk")["position"].unique().tolist()
    assert sorted(positions) == [31, 63]  # only the sampled queries keep full lists
    assert len(trace.df("moe_routes")) == 0
    assert trace.session["policy"]["dsa_prefill_stride"] == 32


def test_the_prefill_is_on_disk_before_the_first_generated_token(tmp_path):
    """The end of a prefill flushes its rows (a follower sees the whole prompt at once, and the flush does
    not land in the decode steps); the periodic flushes of decode are spaced as before."""
    model = load_model("preset:tiny")
    session = Session(model, Tokenizer.byte_level(), prefill_chunk=16)
    with workbench.record(session, trace=tmp_path / "t", policy=dataclasses.replace(ALL, flush_seconds=3600.0)):
        session.append(ids=list(range(1, 41)))
        session.prefill()
        # encoded on the writer's thread: no other forward runs, the rows arrive anyway
        deadline = time.monotonic() + 30
        while True:
            live = workbench.open_trace(tmp_path / "t")
            # parts appear table by table: wait for every table read below
            written = all(live.parts(t) for t in ("kda_norms", "dsa_topk", "moe_counts"))
            if len(live.tokens()) == 40 and written or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert live.status == "recording" and len(live.tokens()) == 40
        assert sorted(set(live.df("kda_norms")["position"])) == [15, 31, 39]  # every chunk's last position
        assert live.df("dsa_topk")["position"].max() == 39
        assert live.df("moe_counts")["count"].sum() > 0
    assert workbench.open_trace(tmp_path / "t").status == "complete"


def test_failed_session_keeps_what_was_recorded(tmp_path):
    model = load_model("preset:tiny")
    session = Session(model, Tokenizer.byte_level(), prefill_chunk=16)
    with pytest.raises(RuntimeError, match="boom"):
        with workbench.record(session, trace=tmp_path / "t"):
            session.append(ids=list(range(40)))
            session.prefill()
            raise RuntimeError("boom")
    trace = workbench.open_trace(tmp_path / "t")
    assert trace.status == "failed" and len(trace.tokens()) == 40
    assert len(trace.df("dsa_key_counts")) > 0
    assert all(p.sink is None for p in probe_points(model))
    with pytest.raises(workbench.TraceError):  # never silently replaced
        with workbench.record(session, trace=tmp_path / "t"):
            pass
    np.testing.assert_equal(trace.df("dsa_sink")["queries"].sum() > 0, True)


def test_recorded_kda_norms_equal_recurrent_reference(recorded):
    """Norms of S at the recorded positions == fla's naive recurrence run on checkpoint weights."""
    from fla.ops.kda.naive import naive_recurrent_kda

    model, ckpt, trace, inputs, n = recorded
    cfg = model.config
    norms = trace.df("kda_norms")
    H, D = cfg.kda_num_heads, cfg.kda_head_dim
    checked = 0
    for layer in [i for i in range(cfg.num_hidden_layers) if cfg.is_kda_layer(i)]:
        p = f"language_model.model.layers.{layer}.self_attn."
        x = inputs[layer][:n]

        def conv(name: str) -> torch.Tensor:
            pre = (x @ checkpoint_tensor(ckpt, p + f"{name}_proj.weight").T).T.unsqueeze(0)  # [1, D, T]
            w = checkpoint_tensor(ckpt, p + f"{name}_conv1d.weight")
            out = torch.nn.functional.conv1d(torch.nn.functional.pad(pre, (3, 0)), w, groups=pre.shape[1])
            return torch.nn.functional.silu(out)[0].T.reshape(n, H, D)

        def l2(t: torch.Tensor) -> torch.Tensor:
            return t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)

        q, k, v = l2(conv("q")), l2(conv("k")), conv("v")
        z = (x @ checkpoint_tensor(ckpt, p + "f_a_proj.weight").T @ checkpoint_tensor(ckpt, p + "f_b_proj.weight").T
             + checkpoint_tensor(ckpt, p + "dt_bias")).view(n, H, D)
        a = checkpoint_tensor(ckpt, p + "A_log").reshape(-1)[:H].exp().view(H, 1)
        g = cfg.kda_gate_lower_bound * torch.sigmoid(a * z)
        beta = torch.sigmoid(x @ checkpoint_tensor(ckpt, p + "b_proj.weight").T)
        rows = norms[norms["layer"] == layer].sort_values("position")
        state, done = None, 0
        for pos, recorded_norm, rank, half, share in zip(rows["position"], rows["norm"], rows["eff_rank"],
                                                          rows["half_life"], rows["global_share"]):
            if pos >= n:
                continue
            sl = slice(done, pos + 1)
            _, state = naive_recurrent_kda(q[None, sl], k[None, sl], v[None, sl], g[None, sl], beta[None, sl],
                                           initial_state=state, output_final_state=True)
            expected = torch.linalg.vector_norm(state[0], dim=(-2, -1))
            np.testing.assert_allclose(np.asarray(recorded_norm, np.float64), expected.numpy(), rtol=2e-3)
            # memory health: effective rank by a float64 SVD, half-lives from the interval's mean g
            np.testing.assert_allclose(np.asarray(rank, np.float64), effective_rank(state[0].numpy()), rtol=1e-3)
            lives = np.sort(np.log(2.0) / -g[sl].mean(0).numpy(), axis=-1)  # [H, D]
            np.testing.assert_allclose(np.asarray(half, np.float64), lives[:, (D - 1) // 2], rtol=1e-3)
            np.testing.assert_allclose(np.asarray(share, np.float64), (lives > pos + 1).mean(-1), atol=1e-6)
            done = pos + 1
            checked += 1
    assert checked >= 12


def test_recorded_dense_overlap_is_consistent(recorded):
    """policy `all` records IoU / recall of the dense top-k beside each dense-mass query (opt-in measure)."""
    _, _, trace, _, _ = recorded
    mass = trace.df("dsa_dense_mass")
    assert len(mass) and mass["iou"].notna().all()
    assert ((mass["iou"] >= 0) & (mass["iou"] <= mass["recall"] + 1e-6) & (mass["recall"] <= 1 + 1e-6)).all()


# runtime.compile settings a recorded session is checked under: the static step run eagerly, the
# compiled step traced by dynamo + AOT autograd without code generation (seconds: every CI run), and
# inductor's real compile (minutes on a 2-core CPU: opt-in)
COMPILE_MODES = [pytest.param(("static", None), id="static-step"),
                 pytest.param((True, "aot_eager"), id="compiled-aot"),
                 pytest.param((True, "inductor"), id="compiled", marks=[pytest.mark.slow, pytest.mark.skipif(
                     os.environ.get("K3WB_COMPILE_TESTS") != "1",
                     reason="an inductor compile takes minutes on a 2-core CPU: set K3WB_COMPILE_TESTS=1")])]


@pytest.fixture
def compile_mode(request, recorded, monkeypatch):
    """Set `runtime.compile` (and the step's compiler) on the recorded model for one test."""
    setting, backend = request.param
    if backend is not None:
        monkeypatch.setattr(decode_step, "BACKEND", backend)
    model = recorded[0]
    model.runtime.compile = setting
    yield setting
    model.runtime.compile = "auto"


@pytest.mark.parametrize("compile_mode", COMPILE_MODES, indirect=True)
def test_recording_with_compiled_decode(recorded, tmp_path, compile_mode):
    """With `runtime.compile` on, an unrecorded session decodes through the static/compiled step and a
    recorded one (listeners attached) through the eager forward: same tokens, same selections, and
    the trace equals one recorded with compilation off."""
    model, _, off_trace, _, n = recorded
    ids = torch.randint(0, 256, (CONTEXT,), generator=torch.Generator().manual_seed(3)).tolist()

    def run(trace=None):
        s = Session(model, Tokenizer.byte_level(), prefill_chunk=CHUNK)
        s.append(ids=ids, name="context")
        if trace is None:
            return [t.id for t in s.generate(NEW_TOKENS, temperature=0, stop_ids=())]
        with workbench.record(s, trace=trace, policy="all"):
            return [t.id for t in s.generate(NEW_TOKENS, temperature=0, stop_ids=())]

    plain = run()
    recorded_tokens = run(tmp_path / "t")
    assert plain == recorded_tokens
    on_trace = workbench.open_trace(tmp_path / "t")
    for table in ("dsa_topk", "moe_routes"):
        a = on_trace.df(table).sort_values(["layer", "position"]).reset_index(drop=True)
        b = off_trace.df(table).sort_values(["layer", "position"]).reset_index(drop=True)
        assert len(a) == len(b) > 0
        col = "selected" if table == "dsa_topk" else "experts"
        assert all(np.array_equal(x, y) for x, y in zip(a[col], b[col])), table


@pytest.mark.parametrize("compile_mode", COMPILE_MODES, indirect=True)
def test_default_policy_records_from_the_compiled_step(recorded, tmp_path, compile_mode):
    """The default policy's signals are collected inside the static/compiled step (no eager fallback):
    every decode step runs through it, and the trace equals one recorded with compilation off
    (selections, routes and dense-mass positions exactly; KDA norms and masses to float tolerance)."""
    model = recorded[0]
    ids = torch.randint(0, 256, (CONTEXT,), generator=torch.Generator().manual_seed(4)).tolist()
    policy = dataclasses.replace(workbench.RecordPolicy(), dense_mass_decode_every=3)

    def run(trace, setting):
        model.runtime.compile = setting
        s = Session(model, Tokenizer.byte_level(), prefill_chunk=CHUNK)
        s.suppressed_ids = s.suppressed_ids | {model.config.eos_token_id}  # never stop early
        with workbench.record(s, trace=trace, policy=policy):
            s.append(ids=ids, name="context")
            return [t.id for t in s.generate(10, temperature=0, stop_ids=())]

    eager = run(tmp_path / "eager", False)
    step = decode_step.DecodeStep.of(model)
    before = step.steps
    compiled = run(tmp_path / "compiled", compile_mode)
    assert compiled == eager
    assert step.steps - before == 9  # every decode step of the recorded session ran the step
    a, b = workbench.open_trace(tmp_path / "eager"), workbench.open_trace(tmp_path / "compiled")
    for table, exact, close in (("dsa_topk", "selected", None), ("moe_routes", "experts", "weights"),
                                ("kda_norms", None, "norm"), ("dsa_dense_mass", None, "mass")):
        x = a.df(table).sort_values(["layer", "position"]).reset_index(drop=True)
        y = b.df(table).sort_values(["layer", "position"]).reset_index(drop=True)
        assert len(x) == len(y) > 0, table
        assert x["position"].tolist() == y["position"].tolist(), table
        if exact is not None:
            assert all(np.array_equal(u, v) for u, v in zip(x[exact], y[exact])), table
        if close is not None:
            np.testing.assert_allclose(np.stack(list(map(np.asarray, x[close]))).astype(np.float64),
                                       np.stack(list(map(np.asarray, y[close]))).astype(np.float64),
                                       rtol=1e-4, atol=1e-6, err_msg=table)
    assert (b.df("dsa_dense_mass")["position"] >= CONTEXT).any()  # decode steps were measured


@pytest.mark.parametrize("compile_mode", COMPILE_MODES, indirect=True)
def test_recording_a_window_of_a_compiled_session(recorded, tmp_path, compile_mode):
    """Decode through the compiled step, record a window (the eager forward, listeners attached),
    decode compiled again: the tokens of a session decoded eagerly throughout, a trace of exactly
    the window's steps, and every sink detached after it (the compiled step runs again)."""
    model = recorded[0]
    ids = torch.randint(0, 256, (CONTEXT,), generator=torch.Generator().manual_seed(5)).tolist()

    def session() -> Session:
        s = Session(model, Tokenizer.byte_level(), prefill_chunk=CHUNK)
        s.suppressed_ids = s.suppressed_ids | {model.config.eos_token_id}  # never stop early
        s.append(ids=ids, name="context")
        return s

    model.runtime.compile = False
    reference = [t.id for t in session().generate(12, temperature=0, stop_ids=())]
    model.runtime.compile = compile_mode
    s = session()
    tokens = [t.id for t in s.generate(4, temperature=0, stop_ids=())]
    with workbench.record(s, trace=tmp_path / "w", policy="all"):
        first = s.length
        tokens += [t.id for t in s.generate(4, temperature=0, stop_ids=())]
        last = s.length
    tokens += [t.id for t in s.generate(4, temperature=0, stop_ids=())]
    assert tokens == reference
    assert all(p.sink is None for p in probe_points(model))
    assert decode_step.DecodeStep.of(model).mode(s.device) != "off"  # the compiled step is back
    trace = workbench.open_trace(tmp_path / "w")
    topk = trace.df("dsa_topk")
    assert sorted(topk["position"].unique()) == list(range(first, last))  # the pending token, then decode
