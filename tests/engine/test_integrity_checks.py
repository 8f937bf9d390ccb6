"""`engine.ops.integrity` on plain tensors, the DSA tie band in both selection paths, and the KDA digest that a
snapshot, a restore and a fork carry (issue 41 section 1)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import load_model
from engine.errors import InputError
from engine.ops.dsa.masked import masked_indexer_topk
from engine.ops.dsa.reference import indexer_scores, indexer_topk
from engine.ops.integrity import (chunked_vs_recurrent, frozen_channels, kda_state_faults, router_boundary,
                                  router_faults, router_verdicts, state_digest, topk_ties)
from engine.ops.kda import kda_chunked
from engine.probes import Deferred
from engine.session import Session
from engine.tokenizer import Tokenizer


def test_topk_ties_counts_the_band_and_what_was_left_out():
    scores = torch.tensor([[5.0, 1.0, 1.0, 1.0, 0.0], [3.0, 2.0, 1.0, float("-inf"), float("-inf")]])
    selected = torch.tensor([[5.0, 1.0], [3.0, 2.0]])
    band, cut = topk_ties(scores, selected.amin(-1), selected)
    assert band.tolist() == [3, 1] and cut.tolist() == [2, 0]
    # a row that keeps every candidate (the k-th is -inf) has no band
    band, cut = topk_ties(scores[1:], torch.tensor([float("-inf")]), scores[1:, :2])
    assert band.tolist() == [0] and cut.tolist() == [0]


def plateau_inputs(T: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, 2, 8, generator=g)
    w = torch.rand(1, T, 2, generator=g)
    k = torch.randn(1, T, 8, generator=g)
    k[:, 5:30] = k[:, 4:5]  # a plateau: 26 equal keys, so equal scores straddle rank k
    return q, w, k, torch.arange(T)


@pytest.mark.parametrize("key_block", [None, 7, 16])
def test_blockwise_tie_band_equals_one_pass_and_the_earliest_keys_win(key_block):
    q, w, k, pos = plateau_inputs()
    topk = 12
    idx, scores, band, cut = indexer_topk(q, w, k, pos, topk, key_block=key_block, ties=True)
    # the plain count over every visible key, row by row
    # the plain count over every visible key, each score computed as in its key block (a matmul's rounding
    # may depend on its width: equal keys tie exactly within one block, not always across blocks)
    width = key_block or 40
    full = torch.cat([indexer_scores(q, w, k[:, s:s + width]) for s in range(0, 40, width)], -1)  # [1, T, T]
    full = full.masked_fill(torch.arange(40) > pos.view(-1, 1), float("-inf"))
    want_band, want_cut = topk_ties(full, scores.amin(-1), scores)
    assert torch.equal(band, want_band) and torch.equal(cut, want_cut)
    assert int((cut > 0).sum()) > 0  # the plateau decided some rows
    # the documented rule: among keys tied at the k-th score, the earliest are kept
    for t in torch.nonzero(cut[0] > 0).flatten().tolist():
        kth = scores[0, t].min()
        tied_kept = idx[0, t][scores[0, t] == kth]
        tied_all = torch.nonzero(full[0, t] == kth).flatten()
        assert torch.equal(tied_kept, tied_all[: len(tied_kept)])


def test_decode_step_selection_reports_the_same_band_and_selection():
    q, w, k, pos = plateau_inputs()
    topk, cap = 12, 48
    buffer = torch.zeros(1, cap, 8)
    buffer[:, :40] = k
    ref = indexer_topk(q, w, k, pos, topk, ties=True)
    masked = masked_indexer_topk(q, w, buffer, pos, topk, ties=True)
    for a, b in zip(ref, masked):
        assert torch.equal(a, b)


@pytest.mark.parametrize("plateau", [True, False])
def test_a_decode_step_defers_only_a_band_no_tie_cut(plateau):
    """`defer_ties`: one query row whose selection no tie decided hands band and cut over as Deferred of its
    selected scores, equal to the eager values; a row a tie decided is computed at once."""
    q, w, k, pos = plateau_inputs(seed=3)
    if not plateau:
        k = torch.randn(k.shape, generator=torch.Generator().manual_seed(4))
    topk, kinds = 12, []
    for t in (20, 39):  # one decode query at a time, over the keys up to it
        eager = indexer_topk(q[:, t:t + 1], w[:, t:t + 1], k[:, :t + 1], pos[t:t + 1], topk, ties=True)
        lazy = indexer_topk(q[:, t:t + 1], w[:, t:t + 1], k[:, :t + 1], pos[t:t + 1], topk, ties=True,
                            defer_ties=True)
        deferred = [isinstance(v, Deferred) for v in lazy[2:]]
        assert deferred in ([True, True], [False, False])
        assert deferred[0] == (int(eager[3].sum()) == 0)
        kinds.append(deferred[0])
        for a, b in zip(eager, lazy):
            assert torch.equal(a, b.value() if isinstance(b, Deferred) else b)
    assert kinds == ([False, False] if plateau else [True, True])  # the plateau straddles rank k: decided by the tie-break


def test_router_faults_find_nan_logits_and_boundary_ties():
    logits = torch.tensor([[0.5, 0.2, 0.2, -1.0], [float("nan"), 0.1, 0.3, 0.0]])
    choice = torch.sigmoid(logits)
    ids = torch.tensor([[0, 1], [2, 1]])
    nonfinite, ties = router_faults(logits, choice, ids)
    assert nonfinite.tolist() == [0, 1]
    assert ties.tolist() == [1, 0]  # expert 2 ties expert 1 at the boundary and was left out
    # what a router step keeps (three numbers per token), judged later in bulk: the same verdicts
    top = choice.topk(2, dim=-1)
    nonfinite_now, tie_now = router_verdicts(*router_boundary(logits, choice, top.values, top.indices))
    assert nonfinite_now.tolist() == [False, True] and tie_now.tolist() == [True, False]


def test_frozen_channels_and_state_faults():
    g = torch.log(torch.tensor([[0.999, 0.5, 1.0, 0.9995]]))
    assert frozen_channels(g).tolist() == [1.0]  # fp32: only the exact 1.0
    assert frozen_channels(g, torch.bfloat16).tolist() == [3.0]  # bf16: every decay above ~0.998
    norm = torch.tensor([1.0, float("nan"), float("inf"), 2e4])
    assert kda_state_faults(norm, 1e4).tolist() == [False, True, True, True]


def test_chunked_vs_recurrent_is_small_when_right_and_large_with_a_transposed_state():
    g0 = torch.Generator().manual_seed(2)
    B, T, H, K = 1, 21, 2, 8
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g0), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g0), dim=-1)
    v = torch.randn(B, T, H, K, generator=g0)
    g = -0.02 * torch.rand(B, T, H, K, generator=g0)  # slow decay: the initial state still counts at the end
    beta = torch.rand(B, T, H, generator=g0)
    initial = torch.randn(B, H, K, K, generator=g0)
    _, right = kda_chunked(q, k, v, g, beta, initial, chunk_size=8)
    _, wrong = kda_chunked(q, k, v, g, beta, initial.transpose(-1, -2), chunk_size=8)
    assert chunked_vs_recurrent(q, k, v, g, beta, initial, right).max() < 1e-4
    assert chunked_vs_recurrent(q, k, v, g, beta, initial, wrong).min() > 1e-2


def test_state_digest_tells_a_copy_from_a_change():
    a = torch.randn(2, 3)
    assert state_digest([("x", a)]) == state_digest([("x", a.clone())])
    b = a.clone()
    b[1, 2] = torch.nextafter(b[1, 2], torch.tensor(9.0))
    assert state_digest([("x", a)]) != state_digest([("x", b)])


def test_snapshot_restore_and_fork_carry_the_kda_digest(checkpoint_dir, tmp_path):
    model = load_model(checkpoint_dir("tiny", "k3.1", seed=4, dtype=torch.float32))
    session = Session(model, Tokenizer.byte_level(), prefill_chunk=16, progress=False)
    session.append(ids=list(range(30)))
    session.prefill()
    state = session.state_dict()
    assert len(state["kda_digest"]) == 32
    fork = session.fork()  # restore checks the digest: equal state, no error
    assert fork.state_dict()["kda_digest"] == state["kda_digest"]
    path = session.save(tmp_path / "snap")
    Session.load(path, model, Tokenizer.byte_level())  # a clean round trip passes the check
    tensors = load_file(str(path / "state.safetensors"))
    name = next(n for n in tensors if n.endswith(".recurrent"))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[7] += 1e-3  # one value of the memory changed on disk
    save_file(tensors, str(path / "state.safetensors"), metadata={"format": "k3-workbench-snapshot"})
    with pytest.raises(InputError, match="restored KDA state differs from the one saved"):
        Session.load(path, model, Tokenizer.byte_level())
