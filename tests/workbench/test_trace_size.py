"""Bytes on disk and writer cost, printed for the record (run with -s to see the numbers).

- a 128K-token synthetic session at demo dimensions (goal: < 200 MB);
- the size per 1M tokens at K3.1 Pro dimensions with a default-like policy, projected from a 1M-token
  run that records every 24th layer of each kind (goal: <= 1.5 GB);
- the cost of one flush carrying about a second of decode at K3.1 Pro dimensions.
"""

from __future__ import annotations

import time

import numpy as np

from workbench.trace import TraceWriter, open_trace
from k3testing.synthetic import Dims, Policy, project_bytes, trace_bytes, write_synthetic_trace

MB = 1e6


def _report(title: str, sizes: dict, tokens: int) -> None:
    parts = ", ".join(f"{k} {v / MB:.2f}" for k, v in sorted(sizes.items(), key=lambda kv: -kv[1])
                      if k not in ("total", "bytes_per_token"))
    print(f"\n{title}: {sizes['total'] / MB:.1f} MB = {sizes['total'] / tokens:.1f} bytes/token ({parts} MB)")


def test_demo_trace_of_128k_tokens_is_small(tmp_path):
    tokens = 131072
    path = write_synthetic_trace(tmp_path / "demo", tokens, Dims.demo(), Policy(), seed=0)
    sizes = trace_bytes(path)
    _report("demo dims, 128K tokens", sizes, tokens)
    assert sizes["total"] < 200 * MB
    t = open_trace(path)
    assert t.problems == [] and t.session["tokens"] == tokens and t.status == "complete"


def test_projected_size_per_million_tokens_at_k31_pro_dims(tmp_path):
    tokens = 1 << 20
    full = Dims.k31_pro()
    assert (len(full.dsa_layers), len(full.kda_layers), full.kda_heads, len(full.moe_layers), full.experts,
            full.topk) == (24, 69, 96, 92, 896, 2048)
    sizes = project_bytes(tmp_path / "proj", tokens, full, Policy(), every=24)
    _report("K3.1 Pro dims, 1M tokens (projected from every 24th layer)", sizes, tokens)
    assert sizes["total"] <= 1.5e9


def test_flush_of_a_second_of_decode_at_full_dims(tmp_path):
    full = Dims.k31_pro()
    rng = np.random.default_rng(0)
    w = TraceWriter.create(tmp_path / "t", {}, fsync=True)
    sel = np.sort(rng.integers(0, 1 << 20, (len(full.dsa_layers), full.topk)), axis=1)
    norms = rng.random((len(full.kda_layers), full.kda_heads)).astype(np.float16)
    experts = rng.integers(0, full.experts, (len(full.moe_layers), full.experts_per_token))
    weights = rng.random(experts.shape).astype(np.float16)
    dsa, kda, moe = (np.array(x) for x in (full.dsa_layers, full.kda_layers, full.moe_layers))
    flushes, appends = [], []
    for second in range(3):
        start = time.perf_counter()
        for step in range(30):  # about one second of decode at 30 tokens/s, one append per signal per step
            s = second * 30 + step
            w.append("dsa_topk", layer=dsa, step=s, rank=0, position=s, selected=sel)
            w.append("dsa_key_counts", layer=np.repeat(dsa, 64), step=s, rank=0, key_bin=np.tile(np.arange(64), 24),
                     count=1)
            w.append("dsa_sink", layer=dsa, step=s, rank=0, position=s, queries=1, sink_hits=1)
            w.append("kda_norms", layer=kda, step=s, rank=0, position=s, norm=norms)
            w.append("moe_routes", layer=moe, step=s, rank=0, position=s, experts=experts, weights=weights,
                     entropy=np.ones(len(moe)))
            w.append("moe_counts", layer=np.repeat(moe, 16), step=s, rank=0, segment=5, modality="text",
                     expert=experts.reshape(-1), count=1)
            w.append("tokens", position=[s], token_id=[s], piece=["x"], segment=5, modality="text")
        appends.append((time.perf_counter() - start) / (30 * 7))
        start = time.perf_counter()
        w.flush()
        flushes.append(time.perf_counter() - start)
    w.close()
    print(f"\nfull dims, 1 s of decode: append {np.median(appends) * 1e6:.0f} us/call, "
          f"flush {np.median(flushes) * 1e3:.0f} ms with fsync (median of 3)")
    assert open_trace(tmp_path / "t").table("dsa_topk").num_rows == 90 * 24
    assert np.median(flushes) < 2.0
