"""The static-shape decode step (engine.decode.step): equal to the eager forward, one graph when compiled.

Compiling with inductor takes minutes on this CPU, so only one test does it (K3.1); the
no-graph-break check for every variant traces with dynamo's "eager" backend (same tracing,
no code generation).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import NEAR_TIE, assert_close, decode_logits, random_ids, topk_boundary_gap
from engine import load_model
from engine.decode import step as decode_step
from engine.decode.step import DecodeStep, decode_forward, static_capacity
from engine.cache import MLACache
from engine.ops.dsa import masked
from engine.ops.dsa.masked import masked_indexer_topk, pruned_top_slots, score_rank
from engine.ops.dsa.reference import indexer_scores, indexer_topk
from engine.session import Session
from engine.tokenizer import Tokenizer

VARIANTS = ("k3.1", "k3", "kimi-linear")


@pytest.fixture(scope="module")
def models():
    return {v: load_model(f"preset:tiny:{v}", seed=1) for v in VARIANTS}


@pytest.mark.parametrize("variant", VARIANTS)
def test_static_step_obeys_the_consistency_law(models, variant):
    """Chunked prefill + static-shape decode steps == the full forward (contexts below and above top-k 16)."""
    model = models[variant]
    ids = random_ids(60, seed=2)
    with torch.inference_mode():
        full = model(torch.tensor([ids]))[0]
    got = decode_logits(model, ids, 8, "static")
    assert_close(got, full, "static decode logits")
    assert float(((got - full).norm(dim=-1) / full.norm(dim=-1)).max()) <= 5e-5


@pytest.mark.parametrize("variant", VARIANTS)
def test_static_step_with_block_pruned_topk_obeys_the_consistency_law(models, variant, monkeypatch):
    """The same law with every indexer top-k of the step taken through `pruned_top_slots` (blocks of 4)."""
    monkeypatch.setattr(masked, "PRUNE_BLOCK", 4)
    monkeypatch.setattr(masked, "PRUNE_MIN_RATIO", 1)
    calls = []
    monkeypatch.setattr(masked, "pruned_top_slots", lambda *a, **kw: calls.append(1) or pruned_top_slots(*a, **kw))
    model = models[variant]
    ids = random_ids(90, seed=3)
    with torch.inference_mode():
        full = model(torch.tensor([ids]))[0]
    got = decode_logits(model, ids, 8, "static")
    assert bool(calls) == (model.config.dsa is not None)
    assert float(((got - full).norm(dim=-1) / full.norm(dim=-1)).max()) <= 5e-5


def test_pruned_top_slots_equal_a_full_rank_topk_with_ties_and_masks():
    """Heavy ties (scores on a coarse grid, equal block maxima), -0.0/+0.0, masked (-inf) slots and
    rows with fewer visible slots than top-k: the same slots as one top-k over every slot's rank."""
    g = torch.Generator().manual_seed(0)
    for block, topk, cap, grid in ((4, 8, 128, 2.0), (8, 5, 320, 0.5), (64, 3, 1024, 0.25), (4, 16, 64, 1.0)):
        scores = (torch.randn(3, 2, cap, generator=g) / grid).round() * grid
        scores[0, 0, ::7] = -0.0
        scores[1, 1, cap // 3:] = float("-inf")      # few visible slots
        scores[2, 0, 5:] = float("-inf")             # fewer visible than top-k
        expected = score_rank(scores, torch.arange(cap)).topk(topk, dim=-1).values
        got = pruned_top_slots(scores, topk, block)
        want = (cap - 1) - (expected & 0xFFFFFFFF)
        assert torch.equal(got.sort(-1).values, want.sort(-1).values), (block, topk, cap)


def test_masked_topk_prunes_blocks_on_long_buffers_and_equals_the_reference():
    g = torch.Generator().manual_seed(1)
    B, Hi, D, topk, cap = 2, 2, 8, 4, 4 * 4 * masked.PRUNE_BLOCK
    k = torch.randn(B, cap, D, generator=g)
    k[:, 100:400] = k[:, 100:101]   # ties across many blocks
    for pos in (2, 300, cap - 1):
        q = torch.randn(B, 1, Hi, D, generator=g)
        w = torch.randn(B, 1, Hi, generator=g)
        ref_idx, ref_s = indexer_topk(q, w, k[:, :pos + 1], torch.tensor([pos]), topk)
        idx, s = masked_indexer_topk(q, w, k, torch.tensor([pos]), topk)
        # the two score the keys in matmuls of other widths (rounding may differ): no near tie may decide
        assert topk_boundary_gap(indexer_scores(q, w, k[:, :pos + 1]), topk) > NEAR_TIE, "near tie; change the seed"
        assert torch.equal(idx, ref_idx), pos
        torch.testing.assert_close(s, ref_s, rtol=1e-5, atol=1e-6)


def test_masked_topk_equals_blockwise_reference_with_ties():
    g = torch.Generator().manual_seed(0)
    B, Hi, D, topk, cap = 2, 3, 8, 16, 64
    k = torch.randn(B, cap, D, generator=g)
    k[:, 10:30] = k[:, 10:11]  # repeated keys: exact score ties straddle the k-th place
    for pos in (5, 16, 40, 63):
        q = torch.randn(B, 1, Hi, D, generator=g)
        w = torch.randn(B, 1, Hi, generator=g)
        ref_idx, ref_s = indexer_topk(q, w, k[:, :pos + 1], torch.tensor([pos]), topk)
        # exact ties (repeated keys) are broken by position in both; a near tie could round either way
        assert topk_boundary_gap(indexer_scores(q, w, k[:, :pos + 1]), topk) > NEAR_TIE, "near tie; change the seed"
        key_major = k.transpose(1, 2).contiguous().transpose(1, 2)  # the CPU cache's layout
        for keys in (k, key_major):
            idx, s = masked_indexer_topk(q, w, keys, torch.tensor([pos]), topk)
            assert torch.equal(idx, ref_idx), pos
            torch.testing.assert_close(s, ref_s, rtol=1e-5, atol=1e-6)  # matmul width may reorder sums
    key_start = torch.tensor([0, 7])
    ref_idx, _ = indexer_topk(q, w, k, torch.tensor([63]), topk, key_start=key_start)
    idx, _ = masked_indexer_topk(q, w, k, torch.tensor([63]), topk, key_start=key_start)
    assert torch.equal(idx, ref_idx)


def test_score_rank_orders_by_score_then_earliest_position():
    values = [0.0, -0.0, 1.5, -2.0, float("-inf"), 1.5, -1e-30, 3e38, -3e38, float("-inf"), 1e-45, -1e-45]
    scores = torch.tensor([values])
    rank = score_rank(scores, torch.arange(len(values)))[0]
    assert len(set(rank.tolist())) == len(values)
    expected = sorted(range(len(values)), key=lambda i: (-values[i], i))  # -0.0 == 0.0: position decides
    assert rank.argsort(descending=True).tolist() == expected


def test_cpu_index_keys_stay_key_major_when_grown(models):
    config = models["k3.1"].config
    layer = config.mla_layers[0]
    cache = MLACache.empty(config, layer, 1, capacity=8)
    assert cache.index_keys.shape == (1, 8, config.dsa.head_dim) and cache.index_keys.stride(1) == 1
    cache.index_keys[0, 3] = 1.0
    cache.grow_to(40)
    assert cache.index_keys.shape[1] == 40 and cache.index_keys.stride(1) == 1
    assert float(cache.index_keys[0, 3].min()) == 1.0 and float(cache.index_keys[0, 4:].abs().max()) == 0.0


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_step_traces_into_one_graph(models, variant):
    """fullgraph=True: no graph break anywhere in the step (dynamo's tracing, no code generation)."""
    model = models[variant]
    s = Session(model)
    s.append(ids=random_ids(20))
    s.prefill()
    DecodeStep.of(model).reserve(s.state, s.length + 1)
    torch._dynamo.reset()
    fn = torch.compile(decode_forward, fullgraph=True, dynamic=False, backend="eager")
    with torch.inference_mode():
        got = fn(model, torch.tensor([[3]]), s.state, torch.tensor(s.length))
    assert got.shape == (1, 1, model.config.vocab_size)
    assert static_capacity(s.length + 1, 16) == s.state.layers[2].capacity


def test_static_capacity_grows_by_eighths_on_cpu_and_doubles_on_cuda():
    assert [static_capacity(n) for n in (1, 1024, 1025, 2049, 131_073, 1 << 20)] == \
        [1024, 1024, 2048, 3072, 147_456, 1 << 20]
    assert [static_capacity(n, doubling=True) for n in (1, 1025, 2049, 131_073)] == [1024, 2048, 4096, 262_144]
    assert static_capacity(100, 2048) == 3072 > 2048  # always above top-k
    for n in range(1000, 300_000, 997):  # at most an eighth more slots than needed (past MIN_CAPACITY)
        cap = static_capacity(n)
        assert n <= cap <= max(1024 * -(-n // 1024), n * 1.125 + 1024)


def test_one_graph_across_cache_growth(models, monkeypatch):
    """The capacity dimension is symbolic: decoding past a capacity grows the caches without a second
    compile, guards are skipped once a key ran clean, and the tokens are the eager forward's."""
    monkeypatch.setattr(decode_step, "BACKEND", "aot_eager")
    monkeypatch.setattr(decode_step, "MIN_CAPACITY", 64)  # the prefill's 256 slots then grow to 320 in decode
    model = models["k3.1"]
    ids = random_ids(250, seed=6)
    runs, capacities = [], []
    for mode in (False, True):
        model.runtime.compile = mode
        s = Session(model, prefill_chunk=64)
        s.suppressed_ids = s.suppressed_ids | {model.config.eos_token_id}
        s.append(ids=ids)
        runs.append([t.id for t in s.generate(30, temperature=0, stop_ids=())])
        capacities.append(s.state.layers[2].capacity)
    model.runtime.compile = "auto"
    step = DecodeStep.of(model)
    assert runs[0] == runs[1]
    assert capacities[1] == static_capacity(279, 16) == 320  # grew once during decode
    assert step.compiles == 1 and len(step._checked) >= 2  # before and after the growth
    del model._decode_step  # later tests count their own compiles
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("K3WB_COMPILE_TESTS") != "1",
                    reason="an inductor compile takes minutes on a 2-core CPU: set K3WB_COMPILE_TESTS=1")
def test_compiled_decode_equals_eager(models):
    """Inductor-compiled decode: same greedy tokens, logits within 1e-5 of the eager forward (fp32)."""
    model = models["k3.1"]
    torch._dynamo.reset()  # count this test's compiles only (an earlier test may have compiled this graph)
    if hasattr(model, "_decode_step"):
        del model._decode_step
    ids = random_ids(40, seed=4)
    eager = decode_logits(model, ids, 10, False)
    compiled = decode_logits(model, ids, 10, True)
    assert torch.equal(compiled.argmax(-1), eager.argmax(-1))
    assert float((compiled - eager).abs().max()) <= 1e-5 * max(1.0, float(eager.abs().max()))
    step = DecodeStep.of(model)
    assert step.compiles == 1  # one capacity, one graph
    # greedy generation through the public API gives the same tokens
    runs = []
    for mode in (False, True):
        model.runtime.compile = mode
        s = Session(model)
        s.append(ids=ids[:12])
        runs.append([t.id for t in s.generate(12, temperature=0, stop_ids=())])
    model.runtime.compile = "auto"
    assert runs[0] == runs[1]


def test_a_sampled_finisher_listens_only_at_its_measured_steps() -> None:
    """`dsa.dense_mass` (finished on the host) is passed to the step only at the steps its request measures:
    the other steps collect nothing for it, and each listener set is one tuple object, reused."""
    from engine.probes import ProbeRequest, probe_points

    model = load_model("preset:tiny:k3.1", seed=3)
    points = [p for p in probe_points(model) if p.name in ("dsa.topk", "dsa.dense_mass")]
    seen = []
    for p in points:
        p.attach(seen.append, ProbeRequest(decode_every=2) if p.name == "dsa.dense_mass" else ProbeRequest())
    try:
        session = Session(model, Tokenizer.byte_level(), prefill_chunk=16, progress=False)
        session.append(ids=random_ids(24))
        session.prefill()
        step = DecodeStep.of(model)
        listeners = []
        for _ in range(4):
            model.probe_context.begin(step=session.step, phase="decode")
            listeners.append(step._listeners())
            step([65], session.state, torch.device("cpu"), compiled=False)
            model.probe_context.end()
            session.state.length += 1
            session.step += 1
        kept = [{p.name for p in s.points} for s in step.tape.steps]
    finally:
        for p in points:
            p.detach()
    measured = [(session.step - 4 + i) % 2 == 0 for i in range(4)]
    assert kept == [{"dsa.topk", "dsa.dense_mass"} if m else {"dsa.topk"} for m in measured]
    assert listeners[0] is listeners[2] and listeners[1] is listeners[3] and listeners[0] is not listeners[1]
    mass = [e for e in seen if e.point.name == "dsa.dense_mass" and e.phase == "decode"]
    assert mass and all(e.step % 2 == 0 for e in mass)
