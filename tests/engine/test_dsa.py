"""DSA oracles: indexer top-k, sparse and dense MLA attention, and model-level DSA invariants.

- `indexer_topk` on our `Indexer`'s projections selects the same key sets as transformers'
  `DeepseekV32Indexer` given the same weights (its RoPE made the identity: cos = 1, sin = 0), away
  from ties between the k-th and (k+1)-th score.
- The blockwise running top-k equals a one-shot top-k over the full (test-only) score matrix, for
  several query/key block sizes; empty slots are -1 and indices come back ascending.
- `sparse_attention_latent` equals dense softmax attention masked to the selected keys.
- `dense_attention_latent` == `dense_attention_expanded` == a naive float64 softmax attention,
  for prefill and for a few queries over a longer cache.
- Model level (tiny K3.1 preset, top-k 16): DSA == dense reads when no query sees more than top-k
  keys, run through the sparse kernel; a K3.1 checkpoint whose top-k covers the whole sequence gives
  the K3 logits of the same weights, and the K3 preset is the K3.1 preset minus the indexer tensors.

All fp32, relative error <= 1e-5.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

import engine.layers.mla as mla_module
from engine import load_model
from engine.config import DSAConfig
from engine.layers.indexer import Indexer
from engine.ops.dsa.reference import indexer_scores, indexer_topk
from engine.ops.mla.reference import dense_attention_expanded, dense_attention_latent, sparse_attention_latent
from engine.presets import get_preset
from engine.weights.write import write_checkpoint
from tests.helpers import NEAR_TIE, assert_close, topk_boundary_gap

pytestmark = pytest.mark.usefixtures("nan_poison")  # unwritten outputs of ops and kernels fail loudly
SEED = 42
TIE_GAP = 1e-4  # relative gap between the k-th and (k+1)-th score below which a query counts as tied


def reference_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Float64 I[t, s] = sum_h w[t, h] relu(q[t, h] . k[s] / sqrt(D)), causal (future = -inf). [B, T, T]"""
    T, D = q.shape[1], q.shape[-1]
    logits = torch.einsum("bthd,bsd->bths", q.double(), k.double()) / D ** 0.5
    scores = torch.einsum("bths,bth->bts", logits.relu(), w.double())
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf"))


def untied_queries(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """[B, T] bool: queries whose k-th and (k+1)-th visible scores are clearly apart (or that keep all keys)."""
    T = scores.shape[-1]
    if T <= topk:
        return torch.ones(scores.shape[:2], dtype=torch.bool)
    top = scores.topk(topk + 1, dim=-1).values  # [B, T, k + 1]
    kth, next_ = top[..., topk - 1], top[..., topk]
    gap = (kth - next_) / kth.abs().clamp_min(1e-12)
    keeps_all = torch.arange(T) < topk  # fewer than k + 1 visible keys: nothing to tie with
    return keeps_all | (gap > TIE_GAP)


def selected_sets(idx: torch.Tensor) -> list[list[set[int]]]:
    return [[{int(s) for s in row if s >= 0} for row in batch] for batch in idx]


# ---- indexer top-k vs transformers' DeepseekV32Indexer -------------------------------------

INDEXER_CASES = [
    # (T, topk, n_heads, head_dim)
    (37, 8, 5, 24),
    (90, 16, 8, 16),
    (130, 33, 4, 32),
]


@pytest.mark.parametrize(("T", "topk", "heads", "dim"), INDEXER_CASES,
                         ids=[f"T{t}-k{k}-h{h}-d{d}" for t, k, h, d in INDEXER_CASES])
def test_indexer_topk_matches_deepseek_v32(T: int, topk: int, heads: int, dim: int) -> None:
    torch.manual_seed(SEED)
    hidden, q_lora = 40, 20
    ours = Indexer(DSAConfig(n_heads=heads, head_dim=dim, topk=topk, layers=(0,)), hidden, q_lora)
    with torch.no_grad():
        ours.k_norm.weight.normal_(1.0, 0.3)
        ours.k_norm.bias.normal_(0.0, 0.3)
    hf_config = DeepseekV32Config(hidden_size=hidden, q_lora_rank=q_lora, index_n_heads=heads, index_head_dim=dim,
                                  index_topk=topk, qk_rope_head_dim=8, num_hidden_layers=1)
    theirs = DeepseekV32Indexer(hf_config, layer_idx=0)
    # the same weights; transformers' k_norm is a plain LayerNorm (weight + bias, eps 1e-6) like ours
    theirs.load_state_dict(ours.state_dict())
    assert theirs.k_norm.eps == ours.k_norm.eps

    x = torch.randn(2, T, hidden)
    q_resid = torch.randn(2, T, q_lora)
    with torch.no_grad():
        q, w = ours.queries(q_resid, x)
        keys = ours.keys(x)
        idx, _ = indexer_topk(q, w, keys, torch.arange(T), topk)
        # K3.1 is NoPE: identity rotary (cos = 1, sin = 0) turns transformers' indexer into ours
        rope = hf_config.qk_rope_head_dim
        identity = (torch.ones(2, T, rope), torch.zeros(2, T, rope))
        causal = torch.ones(T, T, dtype=torch.bool).tril().expand(2, T, T)
        hf_idx = theirs(x, q_resid, identity, causal, position_ids=None)

    scores = reference_scores(q, w, keys)
    checked = untied_queries(scores, topk)
    assert checked.float().mean() > 0.9, "too many tied queries: the comparison would say little"
    ours_sets, hf_sets = selected_sets(idx), selected_sets(hf_idx.long())
    for b in range(2):
        for t in range(T):
            visible = set(range(t + 1))
            # transformers returns min(topk, T) indices per query, padding short rows with masked keys
            hf_set = hf_sets[b][t] & visible
            if t + 1 <= topk:
                assert ours_sets[b][t] == visible == hf_set, f"query {t}: every past key must be kept"
            elif checked[b, t]:
                assert ours_sets[b][t] == hf_set, f"batch {b} query {t}: top-{topk} sets differ"


# ---- blockwise running top-k vs one-shot top-k ---------------------------------------------

BLOCK_CASES = [(1, 7), (5, 16), (16, 40), (64, 500), (None, None)]


@pytest.mark.parametrize(("q_block", "key_block"), BLOCK_CASES, ids=[f"qb{q}-kb{k}" for q, k in BLOCK_CASES])
def test_blockwise_topk_equals_one_shot(q_block: int | None, key_block: int | None) -> None:
    gen = torch.Generator().manual_seed(SEED)
    B, T, H, D, topk = 2, 101, 4, 16, 12
    q = torch.randn(B, T, H, D, generator=gen)
    k = torch.randn(B, T, D, generator=gen)
    w = torch.randn(B, T, H, generator=gen)
    idx, scores = indexer_topk(q, w, k, torch.arange(T), topk, q_block=q_block, key_block=key_block)

    full = indexer_scores(q, w, k)  # [B, T, T], test-only
    full = full.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    one_shot = full.topk(topk, dim=-1)
    checked = untied_queries(reference_scores(q, w, k), topk)
    for b in range(B):
        for t in range(T):
            n = min(t + 1, topk)
            row_idx, row_scores = idx[b, t], scores[b, t]
            # filled slots first, ascending positions; empty slots are -1 with score -inf
            assert (row_idx[n:] == -1).all() and torch.isinf(row_scores[n:]).all()
            assert (row_idx[:n].diff() > 0).all()
            if checked[b, t]:
                expected = {int(s) for s, v in zip(one_shot.indices[b, t], one_shot.values[b, t]) if v > float("-inf")}
                assert set(row_idx[:n].tolist()) == expected
                assert torch.allclose(row_scores[:n], full[b, t, row_idx[:n]], rtol=1e-6, atol=1e-6)


def test_topk_for_a_suffix_of_queries() -> None:
    """Queries at positions [start, start + Tq) over a longer key cache (decode / chunked prefill)."""
    gen = torch.Generator().manual_seed(SEED)
    B, Tk, Tq, H, D, topk = 1, 77, 5, 3, 16, 9
    q_all = torch.randn(B, Tk, H, D, generator=gen)
    k = torch.randn(B, Tk, D, generator=gen)
    w = torch.randn(B, Tk, H, generator=gen)
    whole, _ = indexer_topk(q_all, w, k, torch.arange(Tk), topk)
    tail, _ = indexer_topk(q_all[:, -Tq:], w[:, -Tq:], k, torch.arange(Tk - Tq, Tk), topk, key_block=8)
    # other blocks, other matmul shapes: the scores may round differently, so equal selections need no near tie
    scores = indexer_scores(q_all[:, -Tq:], w[:, -Tq:], k)
    scores = scores.masked_fill(torch.arange(Tk) > torch.arange(Tk - Tq, Tk)[:, None], float("-inf"))
    assert topk_boundary_gap(scores, topk) > NEAR_TIE, "inputs put two keys in a near tie; change the seed"
    assert torch.equal(tail, whole[:, -Tq:])


# ---- MLA attention: sparse, latent, expanded --------------------------------------------------

def mla_inputs(B: int, Tq: int, Tk: int, H: int = 3, R: int = 20, Dr: int = 6, Dk: int = 12, Dv: int = 10,
               seed: int = SEED) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "q_nope": torch.randn(B, Tq, H, Dk, generator=gen),
        "q_rope": torch.randn(B, Tq, H, Dr, generator=gen),
        "c": torch.randn(B, Tk, R, generator=gen),
        "k_r": torch.randn(B, Tk, Dr, generator=gen),
        "w_kb": torch.randn(H, Dk, R, generator=gen) / R ** 0.5,
        "w_vb": torch.randn(H, Dv, R, generator=gen) / R ** 0.5,
    }


def naive_attention(x: dict[str, torch.Tensor], q_pos: torch.Tensor, scale: float,
                    allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 softmax attention with expanded keys; `allowed` [B, Tq, Tk] restricts the keys. -> [B, Tq, H, Dv]"""
    d = {k: v.double() for k, v in x.items()}
    keys_nope = torch.einsum("bsr,hdr->bshd", d["c"], d["w_kb"])
    values = torch.einsum("bsr,hvr->bshv", d["c"], d["w_vb"])
    s = (torch.einsum("bthd,bshd->bths", d["q_nope"], keys_nope)
         + torch.einsum("bthd,bsd->bths", d["q_rope"], d["k_r"])) * scale
    Tk = d["c"].shape[1]
    mask = torch.arange(Tk)[None, :] <= q_pos[:, None]  # [Tq, Tk]
    mask = mask.expand(s.shape[0], -1, -1) if allowed is None else mask & allowed
    s = s.masked_fill(~mask[:, :, None, :], float("-inf"))
    return torch.einsum("bths,bshv->bthv", torch.softmax(s, dim=-1), values)


def latent_query(x: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.einsum("bthd,hdr->bthr", x["q_nope"], x["w_kb"])


def from_latent(o_lat: torch.Tensor, x: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.einsum("bthr,hvr->bthv", o_lat, x["w_vb"])


ATTN_CASES = [
    # (Tq, Tk, key_block): prefill, prefill over several key blocks, a few queries over a long cache
    (1, 1, None),
    (37, 37, None),
    (70, 70, 16),
    (3, 130, 64),  # a 2-key tail joins the block before it
    (1, 141, 64),  # a 13-key tail (over an eighth of a block) stays a block of its own
]


@pytest.mark.parametrize(("Tq", "Tk", "key_block"), ATTN_CASES, ids=[f"Tq{q}-Tk{k}-kb{b}" for q, k, b in ATTN_CASES])
def test_dense_latent_equals_expanded_equals_naive(Tq: int, Tk: int, key_block: int | None) -> None:
    x = mla_inputs(2, Tq, Tk)
    q_pos = torch.arange(Tk - Tq, Tk)
    scale = 18 ** -0.5
    expected = naive_attention(x, q_pos, scale)

    keys = torch.cat((torch.einsum("bsr,hdr->bshd", x["c"], x["w_kb"]),
                      x["k_r"][:, :, None].expand(-1, -1, x["w_kb"].shape[0], -1)), dim=-1)
    values = torch.einsum("bsr,hvr->bshv", x["c"], x["w_vb"])
    q = torch.cat((x["q_nope"], x["q_rope"]), dim=-1)
    expanded = dense_attention_expanded(q, keys, values, q_pos, scale, key_block=key_block)
    latent = from_latent(dense_attention_latent(latent_query(x), x["q_rope"], x["c"], x["k_r"], q_pos, scale,
                                                key_block=key_block), x)
    assert_close(expanded, expected, "expanded vs naive")
    assert_close(latent, expected, "latent vs naive")
    assert_close(latent, expanded, "latent vs expanded")


def test_dense_latent_reads_a_view_of_a_larger_cache_as_its_copy() -> None:
    """The decode step passes `cache.latent[:, :end]`, a strided view of a larger buffer (B > 1); BLAS may
    take another path over strided rows, so fp32 tolerance rather than bit equality."""
    x = mla_inputs(2, 2, 150)
    pad = lambda t: torch.cat((t, torch.randn(t.shape[0], 9, t.shape[-1])), dim=1)[:, : t.shape[1]]  # noqa: E731
    c_view, k_r_view = pad(x["c"]), pad(x["k_r"])
    assert not c_view.is_contiguous()
    q_pos, scale = torch.arange(148, 150), 18 ** -0.5
    args = (latent_query(x), x["q_rope"])
    got = dense_attention_latent(*args, c_view, k_r_view, q_pos, scale, key_block=64, key_start=torch.tensor([0, 5]))
    want = dense_attention_latent(*args, x["c"].clone(), x["k_r"].clone(), q_pos, scale, key_block=64,
                                  key_start=torch.tensor([0, 5]))
    assert_close(got, want, "strided view vs contiguous copy")


@pytest.mark.parametrize("q_block", [1, 7, None], ids=["qb1", "qb7", "qb-auto"])
@pytest.mark.parametrize(("Tq", "Tk", "topk"), [(45, 45, 8), (4, 90, 20)], ids=["prefill", "decode"])
def test_sparse_attention_equals_masked_dense(Tq: int, Tk: int, topk: int, q_block: int | None) -> None:
    B = 2
    x = mla_inputs(B, Tq, Tk)
    q_pos = torch.arange(Tk - Tq, Tk)
    scale = 18 ** -0.5
    # a random selection of up to top-k visible keys per query (ascending, -1 padded), always incl. itself
    gen = torch.Generator().manual_seed(SEED + 1)
    idx = torch.full((B, Tq, topk), -1, dtype=torch.long)
    allowed = torch.zeros(B, Tq, Tk, dtype=torch.bool)
    for b in range(B):
        for t, pos in enumerate(q_pos.tolist()):
            past = torch.randperm(pos, generator=gen)[: topk - 1] if pos else torch.empty(0, dtype=torch.long)
            chosen = torch.cat((past, torch.tensor([pos]))).sort().values
            idx[b, t, : len(chosen)] = chosen
            allowed[b, t, chosen] = True
    expected = naive_attention(x, q_pos, scale, allowed)
    o_lat = sparse_attention_latent(latent_query(x), x["q_rope"], x["c"], x["k_r"], idx, scale, q_block=q_block)
    assert_close(from_latent(o_lat, x), expected, "sparse vs masked dense")


def test_sparse_attention_over_all_keys_equals_dense() -> None:
    """A selection holding every visible key (as when t < top-k) is plain causal attention."""
    T, topk = 29, 32
    x = mla_inputs(1, T, T)
    pos = torch.arange(T)
    idx = torch.where(pos[None, :] <= pos[:, None], pos[None, :], torch.full((T, T), -1))
    idx = torch.cat((idx, torch.full((T, topk - T), -1)), dim=-1).unsqueeze(0)
    scale = 18 ** -0.5
    sparse = sparse_attention_latent(latent_query(x), x["q_rope"], x["c"], x["k_r"], idx, scale)
    dense = dense_attention_latent(latent_query(x), x["q_rope"], x["c"], x["k_r"], pos, scale)
    assert_close(sparse, dense, "sparse(all keys) vs dense")


# ---- model-level invariants ------------------------------------------------------------------

def route_through_sparse_kernel(model, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make DSA layers use the sparse kernel even when every query sees <= top-k keys.

    The layer normally takes the (equivalent, cheaper) dense path there; lowering the layer's
    threshold to 0 while the selection still uses the configured top-k exercises the sparse kernel
    on exactly the inputs where DSA and dense must agree. Returns a list counting sparse calls.
    """
    topk = model.config.dsa.topk
    real_topk, real_sparse = mla_module.indexer_topk, mla_module.sparse_attention_latent
    calls: list[int] = []

    def sparse(*args, **kwargs):
        calls.append(1)
        return real_sparse(*args, **kwargs)

    monkeypatch.setattr(mla_module, "indexer_topk", lambda q, w, k, pos, _k, **kw: real_topk(q, w, k, pos, topk, **kw))
    monkeypatch.setattr(mla_module, "sparse_attention_latent", sparse)
    for layer in model.model.layers:
        if getattr(layer.self_attn, "indexer", None) is not None:
            monkeypatch.setattr(layer.self_attn.indexer, "topk", 0)
    return calls


def random_ids(T: int, vocab: int, seed: int = SEED) -> torch.Tensor:
    return torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("T", [1, 11, 16])
def test_dsa_equals_dense_up_to_topk(T: int, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model("preset:tiny", seed=SEED)
    assert model.config.dsa is not None and T <= model.config.dsa.topk
    ids = random_ids(T, model.config.vocab_size)
    with torch.no_grad():
        model.runtime.dsa_force_dense = True
        dense = model(ids)
        model.runtime.dsa_force_dense = False
        default = model(ids)
        calls = route_through_sparse_kernel(model, monkeypatch)
        sparse = model(ids)
    assert calls, "the sparse kernel did not run"
    assert_close(default, dense, "DSA (default path) vs forced dense")
    assert_close(sparse, dense, "DSA (sparse kernel) vs forced dense")


def test_k3_preset_is_k31_minus_indexer() -> None:
    k31 = load_model("preset:tiny", seed=SEED).state_dict()
    k3 = load_model("preset:tiny:k3", seed=SEED).state_dict()
    extra = set(k31) - set(k3)
    assert not set(k3) - set(k31)
    assert extra and all(".self_attn.indexer." in name for name in extra)
    for name, tensor in k3.items():
        assert torch.equal(tensor, k31[name]), name


def test_k31_with_topk_covering_the_sequence_equals_k3(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A K3.1 checkpoint whose top-k >= T (T above the tiny preset's 16) gives the K3 logits of its weights."""
    T = 40
    tiny = get_preset("tiny")
    wide = tiny.replace(dsa=dataclasses.replace(tiny.dsa, topk=64))
    write_checkpoint(wide, tmp_path / "k31", seed=SEED, float_dtype=torch.float32)
    write_checkpoint(get_preset("tiny", "k3"), tmp_path / "k3", seed=SEED, float_dtype=torch.float32)
    k31, k3 = load_model(tmp_path / "k31"), load_model(tmp_path / "k3")
    assert k31.config.dsa.topk == 64 and k3.config.dsa is None
    ids = random_ids(T, tiny.vocab_size)
    with torch.no_grad():
        reference = k3(ids)
        default = k31(ids)
        calls = route_through_sparse_kernel(k31, monkeypatch)
        sparse = k31(ids)
    assert calls, "the sparse kernel did not run"
    assert_close(default, reference, "K3.1 (top-k >= T) vs K3")
    assert_close(sparse, reference, "K3.1 (sparse kernel, top-k >= T) vs K3")
