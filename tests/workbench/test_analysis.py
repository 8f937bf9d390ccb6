"""Analysis functions: hand-made inputs with known answers, then the spec section 6 questions answered
on a synthetic trace whose ground truth is stored in its session.json."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from workbench.analysis import (dense_mass_summary, distance_summary, expert_imbalance, expert_shares,
                                half_decay_tokens, head_dynamics, image_patch_reads, js_divergence, layers_reading,
                                modality_divergence, rank_heads, rank_load_balance, rebin_counts, segment_reads,
                                sink_eviction)
from workbench.analysis.common import log2_bin, log2_bin_quantiles, segment_of
from workbench.trace import open_trace
from k3testing.synthetic import Dims, Policy, write_synthetic_trace

SEGMENTS = pd.DataFrame({"id": [0, 1, 2], "start": [0, 100, 104], "end": [100, 104, 200],
                         "name": ["doc", "img", "ans"], "kind": ["document", "image", "generated"]})


def test_rebin_preserves_totals_at_any_width():
    counts = np.array([4, 0, 8, 2])  # bins of 10 tokens
    assert rebin_counts(counts, 10, np.array([0, 20, 40])).tolist() == [4, 10]
    fine = rebin_counts(counts, 10, np.linspace(0, 40, 9))
    assert fine.sum() == 14 and fine[:2].tolist() == [2, 2]
    assert rebin_counts(counts, 10, np.array([35, 100])).tolist() == [1]


def test_log2_bins_and_quantiles():
    assert log2_bin([0, 1, 2, 3, 6, 7]).tolist() == [0, 1, 1, 2, 2, 3]
    q = log2_bin_quantiles(np.array([0, 0, 0, 10]), [0.0, 0.5, 1.0])
    assert np.allclose(q, [7, 2 ** 3.5 - 1, 15])
    assert segment_of([0, 99, 100, 150, 250], SEGMENTS).tolist() == [0, 0, 1, 2, -1]


@pytest.mark.parametrize("as_arrow", [False, True])
def test_layers_reading_a_needle(as_arrow):
    topk = pd.DataFrame({"layer": [3, 3, 7, 7], "position": [150, 160, 150, 160],
                         "selected": [np.array([0, 10, 11, 149]), np.array([0, 12, 159]), np.array([0, 149]),
                                      np.array([11, 159])]})
    frame = pa.Table.from_pandas(topk) if as_arrow else topk
    got = layers_reading(frame, 10, 13)
    assert got["layer"].tolist() == [3, 7]
    row3 = got.iloc[0]
    assert (row3.queries, row3.queries_reading, row3.keys_read, row3.distance_min) == (2, 2, 3, 139)
    assert got.iloc[1].read_share == 0.5 and got.iloc[1].distance_median == 149
    assert layers_reading(frame, 10, 13, queries=(155, 170))["queries"].tolist() == [1, 1]


def test_distance_summary_and_segment_reads():
    hist = pd.DataFrame({"layer": [3, 3, 7], "log2_bin": [0, 10, 3], "count": [50, 50, 10]})
    got = distance_summary(hist, local=2, far=512).set_index("layer")
    assert got.loc[3, "reads"] == 100 and got.loc[3, "local_share"] == 0.5 and got.loc[3, "far_share"] == 0.5
    assert got.loc[7, "p10"] <= got.loc[7, "p50"] <= got.loc[7, "p90"] and 7 <= got.loc[7, "p50"] < 15
    totals = pd.DataFrame({"layer": [3, 3, 3], "segment": [0, 1, 0], "count": [5, 10, 5]})
    reads = segment_reads(totals, SEGMENTS)
    assert reads[["segment", "share", "name"]].values.tolist() == [[0, 0.5, "doc"], [1, 0.5, "img"]]


def test_sink_eviction_finds_the_step_and_position():
    steps = np.arange(10)
    sink = pd.DataFrame({"layer": np.repeat([3, 7], 10), "step": np.tile(steps, 2),
                         "position": np.tile(steps * 100 + 99, 2), "queries": 100,
                         "sink_hits": np.concatenate([np.full(10, 99), np.where(steps < 6, 98, 5)])})
    got = sink_eviction(sink, threshold=0.5).set_index("layer")
    assert not got.loc[3, "evicted"] and got.loc[3, "first_step_below"] == -1
    assert got.loc[7, "evicted"] and got.loc[7, "first_step_below"] == 6 and got.loc[7, "position_below"] == 699
    assert got.loc[7, "final_rate"] == 0.05


def test_image_patch_reads_and_dense_mass():
    tokens = pd.DataFrame({"position": np.arange(200), "image_id": np.where((np.arange(200) >= 100) &
                                                                              (np.arange(200) < 104), 1, np.nan),
                           "patch_row": np.nan, "patch_col": np.nan})
    tokens.loc[100:103, "patch_row"] = [0, 0, 1, 1]
    tokens.loc[100:103, "patch_col"] = [0, 1, 0, 1]
    topk = pd.DataFrame({"layer": [3, 7], "position": [150, 160], "selected": [np.array([5, 100, 103]),
                                                                               np.array([103, 159])]})
    assert image_patch_reads(topk, tokens, 1, (2, 2)).tolist() == [[1, 0], [0, 2]]
    assert image_patch_reads(topk, tokens, 1, (2, 2), layers=[7]).tolist() == [[0, 0], [0, 1]]
    mass = pd.DataFrame({"layer": [3, 3, 3, 7], "position": [50, 60, 150, 150], "mass": [0.99, 0.8, 0.95, 0.5]})
    got = dense_mass_summary(mass, below=0.9)
    assert got.set_index("layer").loc[3, "share_below"] == pytest.approx(1 / 3)
    per_seg = dense_mass_summary(mass, SEGMENTS)
    assert per_seg[["layer", "segment", "queries"]].values.tolist() == [[3, 0, 2], [3, 2, 1], [7, 2, 1]]


def test_kda_head_dynamics_and_ranking():
    pos = np.arange(64, 4097, 64)
    fast = 10 * np.sqrt(1 - np.exp(-pos / 100))
    slow = 10 * np.sqrt(1 - np.exp(-pos / 5000))
    since = np.where(pos >= 2048, pos - 2048, pos)
    forget = 10 * np.sqrt(1 - np.exp(-(since + 1) / 2000))
    norms = np.stack([fast, slow, forget], axis=1)
    decay = np.broadcast_to(np.exp(-1 / np.array([100, 5000, 2000])), norms.shape)
    segs = pd.DataFrame({"id": [0, 1], "start": [0, 2048], "end": [2048, 5000]})
    got = head_dynamics(pos, norms, decay, segs)
    assert got.loc[0, "plateau_fraction"] < got.loc[2, "plateau_fraction"] < got.loc[1, "plateau_fraction"]
    assert got.loc[2, "max_drop"] > 0.5 and got.loc[2, "drop_position"] == 2048 and got.loc[2, "drop_segment"] == 1
    assert got.loc[0, "max_drop"] == 0 and got.loc[0, "drop_position"] == -1
    assert np.allclose(got["half_decay_tokens"], np.log(2) * np.array([100, 5000, 2000]), rtol=1e-6)
    assert abs(got.loc[0, "late_growth"]) < 1e-6 < got.loc[1, "late_growth"]
    ranked = rank_heads({0: got, 4: got}, by="max_drop", ascending=False, top=2)
    assert ranked[["rank", "head"]].values.tolist() == [[1, 2], [2, 2]] and ranked["layer"].tolist() == [0, 4]
    assert half_decay_tokens(np.array([1.0, 0.5]))[1] == 1 and np.isinf(half_decay_tokens(np.array([1.0]))[0])


def test_moe_modality_divergence_and_rank_load():
    counts = pd.DataFrame({"layer": [1] * 4 + [2] * 4, "modality": ["text", "text", "image", "image"] * 2,
                           "expert": [0, 1, 0, 1, 0, 1, 2, 3], "count": [10, 10, 10, 10, 10, 10, 10, 10]})
    got = modality_divergence(counts).set_index("layer")
    assert got.loc[1, "js_divergence"] == pytest.approx(0) and got.loc[2, "js_divergence"] == pytest.approx(1)
    assert sorted(got.loc[2, "image_experts"][:2]) == [2, 3]
    shares = expert_shares(counts)
    assert shares.query("layer == 1 and modality == 'text'")["share"].tolist() == [0.5, 0.5]
    load = pd.DataFrame({"layer": [1, 1, 2, 2], "ep_rank": [0, 1, 0, 1], "tokens": [30, 10, 20, 20]})
    bal = rank_load_balance(load)
    assert bal.iloc[0][["layer", "imbalance", "busiest_rank"]].tolist() == [1, 1.5, 0]
    assert expert_imbalance(np.array([[1, 1, 4], [0, 0, 0]])).tolist()[0] == 2 and np.isnan(expert_imbalance(
        np.zeros((1, 3)))[0])
    assert np.isnan(js_divergence(np.zeros(3), np.ones(3)))


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    path = tmp_path_factory.mktemp("analysis") / "trace"
    write_synthetic_trace(path, 32768, Dims.demo(), Policy(prefill_chunk=4096, decode_tokens=256, kda_extras=True),
                          seed=11)
    return open_trace(path)


def test_section6_questions_on_a_synthetic_trace(synthetic):
    t = synthetic
    truth = t.session["synthetic"]
    segs = t.segments()
    answer = segs.query("kind == 'generated'").iloc[0]
    # when the model answered, which layers read the needle, and how far back was it?
    reading = layers_reading(t.table("dsa_topk"), *truth["needle"], queries=(answer.start, answer.end - 1))
    assert sorted(reading.query("read_share > 0.5")["layer"]) == truth["needle_layers"]
    assert (reading.query("read_share > 0.5")["distance_min"] > answer.start - truth["needle"][1]).all()
    # did any layer stop reading the attention sink?
    sink = sink_eviction(t.table("dsa_sink"))
    assert sink.query("evicted")["layer"].tolist() == [truth["sink_evicting_layer"]]
    assert sink.query("evicted")["position_below"].iloc[0] >= truth["sink_evicted_from"]
    # which KDA heads forget fastest, and where?
    per_layer = {}
    for layer in t.layers("kda_norms"):
        pos, norms = t.kda_norm_matrix(layer)
        per_layer[layer] = head_dynamics(pos, norms, t.kda_norm_matrix(layer, "mean_decay")[1], segs)
    ranked = rank_heads(per_layer, by="max_drop", ascending=False)
    forgetful = {tuple(x) for x in truth["kda_forgetful_heads"]}
    assert (ranked.iloc[0]["layer"], ranked.iloc[0]["head"]) in forgetful
    assert {(r.layer, r.head) for r in ranked.itertuples() if r.max_drop > 0.3} <= forgetful
    # are image tokens routed to different experts? is an EP rank overloaded?
    div = modality_divergence(t.table("moe_counts"), top=len(truth["image_experts"]))
    assert (div["js_divergence"] > 0.1).all()
    assert all(set(e) <= set(truth["image_experts"]) for e in div["image_experts"])
    assert (rank_load_balance(t.table("moe_rank_load"))["busiest_rank"] == truth["overloaded_ep_rank"]).all()
    # how far back do layers read; how much dense mass does top-k keep; which patches were read?
    dist = distance_summary(t.table("dsa_distance_hist"))
    assert (dist["p10"] <= dist["p50"]).all() and (dist["p50"] <= dist["p90"]).all()
    mass = dense_mass_summary(t.table("dsa_dense_mass"))
    assert ((mass["mean"] > 0.5) & (mass["mean"] <= 1)).all()
    image = segs.query("kind == 'image'").iloc[0]
    grid = (int(image.image_grid_rows), int(image.image_grid_cols))
    patches = image_patch_reads(t.table("dsa_topk"), t.tokens(), int(image.id), grid)
    assert patches.shape == grid and patches.sum() > 0


def test_heatmap_shows_the_needle(synthetic):
    t = synthetic
    truth = t.session["synthetic"]
    lo, hi = truth["needle"]
    width = t.policy["dsa_bin_tokens"]
    answer = t.segments().query("kind == 'generated'").iloc[0]
    first_decode = min(t.table("dsa_topk", positions=(answer.start, answer.start))["step"].to_pylist())
    # while answering (decode steps only), at the native bin resolution
    heat = t.dsa_heatmap(bins=t.session["tokens"] // width, steps=(first_decode, 1 << 30))
    layers = t.layers("dsa_key_counts")
    doc = t.segments().query("name == 'report.pdf'").iloc[0]
    for row, layer in enumerate(layers):
        needle_bin = heat[row, lo // width]
        doc_bins = heat[row, doc.start // width + 4: doc.end // width - 1]
        if layer in truth["needle_layers"]:
            assert needle_bin > 2 * np.median(doc_bins)
    whole = t.dsa_heatmap(bins=7)
    assert whole.shape == (len(layers), 7)
    assert whole.sum() == pytest.approx(t.table("dsa_key_counts")["count"].to_numpy().sum())


def test_token_reads_show_chance_beside_marked_and_local_reads() -> None:
    import pyarrow as pa

    from workbench.analysis.views.readout import reads_html
    from workbench.analysis import TokenText, chance_of_hit, token_reads

    rows = pa.table({"layer": [3], "selected": pa.array([[0, 10, 11, 900, 990]], pa.list_(pa.int64()))})
    segments = [{"id": 0, "kind": "document", "name": "doc", "start": 0, "end": 1000}]
    reads = token_reads(999, rows, TokenText(), segments, bins=10, extent=1000, marks=[(10, 20, "needle")])
    r = reads["rows"][0]
    assert r["marked"] == [2]
    # 5 random picks among the 1,000 visible keys put 5 * 10 / 1000 in a 10-key span
    assert r["marked_expected"] == [pytest.approx(0.05)]
    assert r["marked_chance"] == [pytest.approx(chance_of_hit(1000, 10, 5))]
    assert r["local_chance"] == pytest.approx(128 / 1000)   # LOCAL_WINDOW of the 1,000 visible keys
    page = reads_html(reads, TokenText())
    assert "random: 0.05" in page and "any)" in page
