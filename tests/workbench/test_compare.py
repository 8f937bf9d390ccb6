"""K3 vs K3.1 per layer: `runtime.dsa_dense_layers` and `workbench.compare` on the tiny preset.

Independent checks: forcing every DSA layer dense through the per-layer set equals the all-layers
switch; the layers before the first dense one are bit-identical; the dense layer's own indexer sees
the same input so its (recorded, would-have-read) selections are unchanged; KL and relative
differences against hand computations."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from apps.cli import main
from engine import load_model
from engine.tokenizer import Tokenizer
from workbench.analysis.read_comparison import next_token_kl, read_changes, relative_difference
from workbench.compare import compare_runs

N_TOKENS = 120  # tiny top-k is 16: most queries read sparsely


@pytest.fixture(scope="module")
def tiny():
    return load_model("preset:tiny", seed=5, dtype=torch.float32)


def _ids(n=N_TOKENS):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(11)).tolist()


def test_dense_layers_set_equals_all_layers_switch(tiny):
    x = torch.tensor([_ids()])
    dsa = frozenset(i for i in range(tiny.config.num_hidden_layers) if tiny.config.is_dsa_layer(i))
    with torch.inference_mode():
        sparse = tiny(x)
        tiny.runtime.dsa_force_dense = True
        dense = tiny(x)
        tiny.runtime.dsa_force_dense = False
        tiny.runtime.dsa_dense_layers = dsa
        per_layer = tiny(x)
        tiny.runtime.dsa_dense_layers = frozenset({max(dsa)})
        last_only = tiny(x)
        tiny.runtime.dsa_dense_layers = frozenset()
    assert torch.equal(per_layer, dense) and not torch.equal(dense, sparse)
    assert not torch.equal(last_only, sparse) and not torch.equal(last_only, dense)


def test_compare_runs_layer_by_layer(tiny, tmp_path):
    first_dsa = min(i for i in range(tiny.config.num_hidden_layers) if tiny.config.is_dsa_layer(i))
    result = compare_runs(tiny, Tokenizer.byte_level(), None, ids=_ids(), dense_layers={first_dsa},
                          trace_a=tmp_path / "a", trace_b=tmp_path / "b", out=tmp_path / "cmp", prefill_chunk=32,
                          policy={"dsa_prefill_stride": 1})
    per = result.per_layer().set_index("layer")
    assert (per.loc[: first_dsa - 1, "max_rel_diff"] == 0).all()  # nothing changed before the dense layer
    assert per.loc[first_dsa, "mean_rel_diff"] > 0
    # queries that see <= top-k keys read everything either way: no difference there
    early = result.layers[(result.layers.layer == first_dsa) & (result.layers.position < 16)]
    assert np.allclose(early["rel_diff"], 0, atol=1e-6)
    reads = result.reads.groupby("layer")["changed"].mean()
    assert reads[first_dsa] == 0  # its indexer saw the same input: it would have read the same keys
    assert (reads.drop(first_dsa) > 0).all()  # later DSA layers read differently
    assert len(result.reads[result.reads.layer == first_dsa]) == N_TOKENS
    # KL recomputed from the two runs' logits (torch, float64)
    kl = result.kl["kl"].to_numpy()
    assert kl.shape == (N_TOKENS,) and (kl >= -1e-9).all() and kl[:16].max() < 1e-9 and kl.max() > 0
    written = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert written["dense_layers"] == [first_dsa]
    assert len(pd.read_parquet(tmp_path / "cmp" / "kl.parquet")) == N_TOKENS
    assert "DENSE" in result.summary()


def test_comparison_functions_against_hand_computation():
    rng = np.random.default_rng(0)
    la, lb = rng.normal(size=(5, 7)), rng.normal(size=(5, 7))
    pa_, pb_ = torch.softmax(torch.tensor(la), -1), torch.softmax(torch.tensor(lb), -1)
    expected = torch.nn.functional.kl_div(pb_.log(), pa_, reduction="none").sum(-1).numpy()
    np.testing.assert_allclose(next_token_kl(la, lb), expected, rtol=1e-10)
    a = rng.normal(size=(4, 3))
    np.testing.assert_allclose(relative_difference(a, 2 * a), np.ones(4))
    ta = pd.DataFrame({"layer": [2, 2], "position": [5, 6], "selected": [np.array([0, 1, 2]), np.array([1, 2])]})
    tb = pd.DataFrame({"layer": [2, 2], "position": [5, 6], "selected": [np.array([0, 1, 3]), np.array([1, 2])]})
    ch = read_changes(ta, tb)
    assert list(ch["changed"]) == [True, False] and ch["jaccard"][0] == pytest.approx(2 / 4)
    assert list(ch["only_a"]) == [1, 0] and list(ch["only_b"]) == [1, 0]


def test_cli_compare_rejects_a_layer_that_is_not_dsa(tmp_path, capsys):
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello world")
    code = main(["compare", "--model", "preset:tiny", "--prompt-file", str(prompt), "--dense-layers", "0",
                 "--trace-a", str(tmp_path / "a"), "--trace-b", str(tmp_path / "b")])
    assert code == 2 and "not DSA layers" in capsys.readouterr().err
