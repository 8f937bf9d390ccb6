"""Synthetic traces: a realistic session of any length written through `TraceWriter`, for the dashboard,
performance and size tests (no model needed).

- `Dims` (layer ids and widths, from an engine preset: `Dims.demo()`, `Dims.k31_pro()`) and `Policy`
  (what a default recorder policy keeps: decode-only full top-k lists, every 1024th prefill query,
  KDA norms every 64 tokens, MoE routes for decode + sampled windows).
- `write_synthetic_trace(path, tokens, dims, policy)`: a session of a system turn, a document with a
  planted needle, an image, a second document, a question and a generated answer. Ground truth for
  tests (needle range and the layers that read it, the layer that evicts the sink, forgetful KDA
  heads, image experts, the overloaded EP rank) is stored under session["synthetic"].
- `trace_bytes(path)` and `project_bytes(...)`: measured size per table, and the size at full layer
  counts extrapolated from a run with every n-th layer (each layer's rows are drawn independently).

`python -m k3testing.synthetic OUT --dims demo --tokens 131072` writes one and prints its size.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from k3testing.synthetic_signals import DSAModel, KDAModel, MoEModel, Window
from workbench.trace.writer import TraceWriter

_WORDS = np.array([f"{a}{b}" for a in ("▁the", "▁of", "▁mem", "▁to", "▁st", "▁att", "▁ent", "▁lay", "▁k", "▁ion",
                                       "▁con", "▁re", "▁sp", "▁ar", "▁in", "▁de")
                   for b in ("", "s", "ed", "ing", "er", "ly", "al", "ion", "ory", "ate", "ive", "ure", ",", ".",
                             "ic", "ous")])


@dataclass(frozen=True)
class Dims:
    """Which layers record what, and how wide: derived from a ModelConfig (`from_config`)."""

    dsa_layers: tuple[int, ...]
    topk: int
    kda_layers: tuple[int, ...]
    kda_heads: int
    moe_layers: tuple[int, ...]
    experts: int
    experts_per_token: int
    ep_ranks: int
    media_token_id: int = 0
    vocab: int = 1024

    @classmethod
    def from_config(cls, config, ep_ranks: int = 1) -> "Dims":
        dsa = tuple(config.dsa.layers) if config.dsa is not None else ()
        moe = tuple(i for i in range(config.num_hidden_layers) if config.is_moe_layer(i))
        return cls(dsa_layers=dsa, topk=config.dsa.topk if config.dsa else 0, kda_layers=tuple(config.kda_layers),
                   kda_heads=config.kda_num_heads, moe_layers=moe, experts=config.num_experts,
                   experts_per_token=config.num_experts_per_token, ep_ranks=ep_ranks,
                   media_token_id=config.media_placeholder_token_id or 0, vocab=config.vocab_size)

    @classmethod
    def demo(cls) -> "Dims":
        from engine.presets import get_preset

        return cls.from_config(get_preset("demo"), ep_ranks=2)

    @classmethod
    def k31_pro(cls) -> "Dims":
        from engine.presets import get_preset

        return cls.from_config(get_preset("k3.1-pro"), ep_ranks=8)

    def every_nth_layer(self, n: int) -> "Dims":
        """The same dims with every n-th layer of each kind (for size projections)."""
        return replace(self, dsa_layers=self.dsa_layers[::n], kda_layers=self.kda_layers[::n],
                       moe_layers=self.moe_layers[::n])


@dataclass(frozen=True)
class Policy:
    """A default-like recorder policy (stored in session.json "policy")."""

    dsa_bin_tokens: int = 256
    sink_tokens: int = 4
    prefill_chunk: int = 8192
    dsa_prefill_stride: int = 1024  # full top-k lists for every n-th prefill query (plus all decode steps)
    dsa_scores: bool = False
    dense_mass_stride: int = 1024  # prefill queries with a dense-mass probe; decode: every 16th step
    kda_every: int = 64  # KDA norms at chunk boundaries of the kernel (every 64 tokens) and every decode token
    kda_extras: bool = False  # max |S|, mean decay, mean beta
    moe_window_every: int = 8192  # full MoE routes for a window of moe_window_len tokens every n tokens
    moe_window_len: int = 64
    decode_tokens: int = 1024
    decode_flush_every: int = 32  # decode steps between flushes (about one second at 30 tokens/s)


def _layout(tokens: int, policy: Policy) -> tuple[list[dict], int, tuple[int, int]]:
    """Segments of the session, the prompt length, and the needle's token range."""
    if tokens < 1024:
        raise ValueError("a synthetic trace needs at least 1024 tokens")
    decode = min(policy.decode_tokens, tokens // 4)
    prompt = tokens - decode
    grid = int(np.clip(int(math.sqrt(prompt / 32)), 4, 64))
    body = prompt - 64 - grid * grid
    doc1 = int(body * 0.45)
    bounds = [("turn", "system", 32, "text", None), ("document", "report.pdf", doc1, "text", None),
              ("image", "figure-1.png", grid * grid, "image", grid),
              ("document", "appendix.md", body - doc1, "text", None), ("turn", "user", 32, "text", None),
              ("generated", "answer", decode, "text", None)]
    segments, start = [], 0
    for i, (kind, name, n, modality, g) in enumerate(bounds):
        seg = {"id": i, "kind": kind, "name": name, "start": start, "end": start + n, "modality": modality}
        if g is not None:
            seg["image"] = {"width": g * 28, "height": g * 28, "grid_rows": g, "grid_cols": g}
        segments.append(seg)
        start += n
    needle_start = 32 + int(doc1 * 0.3)
    return segments, prompt, (needle_start, needle_start + 16)


class _Generator:
    """Writes one synthetic session window by window (prefill chunks, then runs of decode steps)."""

    def __init__(self, writer: TraceWriter, dims: Dims, policy: Policy, segments: list[dict], prompt: int,
                 needle: tuple[int, int], tokens: int, rng: np.random.Generator) -> None:
        self.w, self.dims, self.policy, self.rng = writer, dims, policy, rng
        self.tokens = tokens
        self.starts = np.array([s["start"] for s in segments])
        self.segment_ids = np.array([s["id"] for s in segments])
        self.segments = segments
        self.image = next(s for s in segments if s["kind"] == "image")
        self.n_bins = -(-tokens // policy.dsa_bin_tokens)
        self.dsa = DSAModel(rng, dims.dsa_layers, dims.topk, policy.sink_tokens, needle, evict_at=prompt // 2)
        self.kda = KDAModel(rng, dims.kda_layers, dims.kda_heads, tokens, self.starts)
        self.moe = MoEModel(rng, dims.moe_layers, dims.experts, dims.experts_per_token, dims.ep_ranks)

    def segment_of(self, pos: np.ndarray) -> np.ndarray:
        return self.segment_ids[np.searchsorted(self.starts, pos, side="right") - 1]

    def window(self, win: Window) -> None:
        pos = np.arange(win.start, win.end)
        self._tokens(pos)
        self._dsa(win, pos)
        self._kda(win, pos)
        self._moe(win, pos)

    def _tokens(self, pos: np.ndarray) -> None:
        img = self.image
        in_img = (pos >= img["start"]) & (pos < img["end"])
        ids = self.rng.integers(0, min(self.dims.vocab, len(_WORDS)), len(pos))
        cell = pos - img["start"]
        grid = img["image"]["grid_cols"]
        self.w.append("tokens", position=pos, token_id=np.where(in_img, self.dims.media_token_id, ids),
                      piece=np.where(in_img, "<|media_pad|>", _WORDS[ids]), segment=self.segment_of(pos),
                      modality=np.where(in_img, "image", "text"), image_id=np.where(in_img, img["id"], -1),
                      patch_row=np.where(in_img, cell // grid, -1), patch_col=np.where(in_img, cell % grid, -1))

    def _dsa(self, win: Window, pos: np.ndarray) -> None:
        p, rng = self.policy, self.rng
        sampled = np.ones(len(pos), bool) if win.decode else (pos % p.dsa_prefill_stride) == p.dsa_prefill_stride - 1
        probed = (pos % 16 == 0) if win.decode else (pos % p.dense_mass_stride) == p.dense_mass_stride - 1
        bin_seg = self.segment_of(np.minimum(np.arange(self.n_bins) * p.dsa_bin_tokens, self.tokens - 1))
        last_step = int(win.steps[-1])
        for i, layer in enumerate(self.dsa.layers):
            tags = {"layer": layer, "rank": 0}
            q = pos[sampled]
            if len(q):
                sel = self.dsa.select(i, q, win.decode)
                scores = rng.standard_normal(sel.shape).astype(np.float32) if p.dsa_scores else None
                self.w.append("dsa_topk", **tags, step=win.steps[sampled], position=q, selected=sel, scores=scores)
            per_bin, per_dist = self.dsa.density(i, win, self.n_bins, p.dsa_bin_tokens)
            counts = rng.poisson(per_bin * len(pos))
            nz = np.flatnonzero(counts)
            self.w.append("dsa_key_counts", **tags, step=last_step, key_bin=nz, count=counts[nz])
            dist = rng.poisson(per_dist * len(pos))
            nz = np.flatnonzero(dist)
            self.w.append("dsa_distance_hist", **tags, step=last_step, log2_bin=nz, count=dist[nz])
            seg_counts = np.bincount(bin_seg, weights=counts, minlength=len(self.segments)).astype(np.int64)
            nz = np.flatnonzero(seg_counts)
            self.w.append("dsa_segment_totals", **tags, step=last_step, segment=self.segment_ids[nz],
                          count=seg_counts[nz])
            hits = rng.binomial(1, self.dsa.sink_rate(i, pos)).sum()
            self.w.append("dsa_sink", **tags, step=last_step, position=int(pos[-1]), queries=len(pos), sink_hits=hits)
            if probed.any():
                self.w.append("dsa_dense_mass", **tags, step=win.steps[probed], position=pos[probed],
                              mass=self.dsa.dense_mass(i, pos[probed]))

    def _kda(self, win: Window, pos: np.ndarray) -> None:
        every = self.policy.kda_every
        mask = np.ones(len(pos), bool) if win.decode else (pos % every) == every - 1
        if not mask.any():
            return
        q = pos[mask]
        for i, layer in enumerate(self.kda.layers):
            stats = self.kda.stats(i, q)
            extras = {k: stats[k] for k in ("max_abs", "mean_decay", "mean_beta")} if self.policy.kda_extras else {}
            self.w.append("kda_norms", layer=layer, rank=0, step=win.steps[mask], position=q, norm=stats["norm"],
                          **extras)

    def _moe(self, win: Window, pos: np.ndarray) -> None:
        p = self.policy
        modality = np.where(self.segment_of(pos) == self.image["id"], "image", "text")
        routed = np.ones(len(pos), bool) if win.decode else (pos % p.moe_window_every) < p.moe_window_len
        seg = self.segment_of(pos)
        ranks = self.moe.rank_of()
        n_layers, n_exp = len(self.moe.layers), self.dims.experts
        layer_col = np.repeat(np.array(self.moe.layers), n_exp)
        expert_col = np.tile(np.arange(n_exp), n_layers)
        load = np.zeros((n_layers, self.dims.ep_ranks), np.int64)
        for s in np.unique(seg):
            mod = "image" if s == self.image["id"] else "text"
            counts = self.moe.counts(mod, int((seg == s).sum()))  # [layers, experts]
            flat = counts.reshape(-1)
            nz = np.flatnonzero(flat)
            self.w.append("moe_counts", layer=layer_col[nz], step=int(win.steps[-1]), rank=0, segment=int(s),
                          modality=mod, expert=expert_col[nz], count=flat[nz])
            load += np.stack([np.bincount(ranks, weights=row, minlength=self.dims.ep_ranks) for row in counts]
                             ).astype(np.int64)
        self.w.append("moe_rank_load", layer=np.repeat(np.array(self.moe.layers), self.dims.ep_ranks),
                      step=int(win.steps[-1]), rank=0, ep_rank=np.tile(np.arange(self.dims.ep_ranks), n_layers),
                      tokens=load.reshape(-1))
        if routed.any():
            for i, layer in enumerate(self.moe.layers):
                experts, weights, entropy = self.moe.routes(i, modality[routed])
                self.w.append("moe_routes", layer=layer, rank=0, step=win.steps[routed], position=pos[routed],
                              experts=experts, weights=weights, entropy=entropy)


def write_synthetic_trace(path: str | Path, tokens: int = 131072, dims: Dims | None = None,
                          policy: Policy | None = None, *, seed: int = 0, overwrite: bool = False,
                          fsync: bool = False) -> Path:
    """Write a complete synthetic trace of `tokens` tokens (prompt + generated answer) and return its path.

    Args:
        path (str | Path): trace directory to create.
        tokens (int): session length (>= 1024); the answer is min(policy.decode_tokens, tokens // 4) tokens.
        dims (Dims, Optional): model dimensions (default: `Dims.demo()`).
        policy (Policy, Optional): recorder policy (default: `Policy()`).
        seed (int): random seed; the same seed writes the same rows.
        overwrite (bool): replace an existing trace at `path`.
        fsync (bool): fsync every part (off by default: the synthetic trace is not precious).
    """
    dims = dims or Dims.demo()
    policy = policy or Policy()
    rng = np.random.default_rng(seed)
    segments, prompt, needle = _layout(tokens, policy)
    session = {
        "model": {"config_hash": "synthetic", "checkpoint": None,
                  "summary": {"dsa_layers": list(dims.dsa_layers), "topk": dims.topk,
                              "kda_layers": list(dims.kda_layers), "kda_heads": dims.kda_heads,
                              "moe_layers": list(dims.moe_layers), "num_experts": dims.experts,
                              "experts_per_token": dims.experts_per_token}},
        "engine": {"device": "synthetic", "ep_ranks": dims.ep_ranks, "prefill_chunk": policy.prefill_chunk},
        "policy": asdict(policy), "segments": segments[:-1],
    }
    writer = TraceWriter.create(path, session, overwrite=overwrite, fsync=fsync)
    gen = _Generator(writer, dims, policy, segments, prompt, needle, tokens, rng)
    step = 0
    for start in range(0, prompt, policy.prefill_chunk):
        end = min(prompt, start + policy.prefill_chunk)
        gen.window(Window(start, end, np.full(end - start, step), decode=False))
        writer.flush()
        step += 1
    writer.update_session(segments=segments, timings={"ttft_s": round(prompt / 6000, 3)})
    for start in range(prompt, tokens, policy.decode_flush_every):
        end = min(tokens, start + policy.decode_flush_every)
        gen.window(Window(start, end, np.arange(step, step + end - start), decode=True))
        step += end - start
        writer.flush()
    truth = {"needle": list(needle), "needle_layers": list(gen.dsa.needle_layers),
             "sink_evicting_layer": gen.dsa.evict_layer, "sink_evicted_from": gen.dsa.evict_at,
             "kda_forgetful_heads": [[gen.kda.layers[i], int(h)] for i, h in zip(*np.nonzero(gen.kda.forgetful))],
             "image_experts": gen.moe.image_experts.tolist(), "overloaded_ep_rank": gen.moe.hot_rank}
    writer.update_session(synthetic=truth, timings={"tpot_s": 0.035, "tokens_per_s": round(1 / 0.035, 1)})
    writer.close()
    return Path(path)


def trace_bytes(path: str | Path, *, footers: bool = False) -> dict[str, int]:
    """Bytes on disk per table (plus "session.json" and "total") of a trace directory.

    With footers=True, also "<table>.footer": the bytes of Parquet footers (schema, statistics), a
    fixed cost per part that does not grow with the number of layers recorded.
    """
    root = Path(path)
    out: dict[str, int] = {}
    for p in root.rglob("*"):
        if not p.is_file() or p.name.startswith("."):
            continue
        rel = p.relative_to(root).parts
        name = rel[0].removesuffix(".parquet") if len(rel) > 1 or p.suffix == ".parquet" else rel[0]
        out[name] = out.get(name, 0) + p.stat().st_size
        if footers and p.suffix == ".parquet":
            key = f"{name}.footer"
            out[key] = out.get(key, 0) + pq.read_metadata(p).serialized_size + 8
    out["total"] = sum(v for k, v in out.items() if not k.endswith(".footer"))
    return out


def project_bytes(path: str | Path, tokens: int, full: Dims, policy: Policy | None = None, *, every: int = 8,
                  seed: int = 0) -> dict[str, float]:
    """Size of a `tokens`-token trace at `full` dims, from a run that records every `every`-th layer.

    The data bytes of per-layer tables are scaled by (layers at full dims) / (layers in the run);
    Parquet footers (a fixed cost per part), tokens and session.json are counted as measured.
    Returns {table: projected bytes, "total": ..., "bytes_per_token": ...}.
    """
    sub = full.every_nth_layer(every)
    write_synthetic_trace(path, tokens, sub, policy, seed=seed, overwrite=True)
    measured = trace_bytes(path, footers=True)
    family = {"dsa": (len(full.dsa_layers), len(sub.dsa_layers)), "kda": (len(full.kda_layers), len(sub.kda_layers)),
              "moe": (len(full.moe_layers), len(sub.moe_layers))}
    out: dict[str, float] = {}
    for name, size in measured.items():
        if name == "total" or name.endswith(".footer"):
            continue
        full_n, sub_n = family.get(name.split("_")[0], (1, 1))
        footer = measured.get(f"{name}.footer", 0)
        out[name] = footer + (size - footer) * full_n / max(sub_n, 1)
    out["total"] = sum(out.values())
    out["bytes_per_token"] = out["total"] / tokens
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="write a synthetic trace and print its size")
    ap.add_argument("out", type=Path)
    ap.add_argument("--dims", choices=["demo", "k3.1-pro"], default="demo")
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--project-every", type=int, default=0,
                    help="record every n-th layer and project the size at full layer counts")
    args = ap.parse_args(argv)
    dims = Dims.demo() if args.dims == "demo" else Dims.k31_pro()
    if args.project_every:
        sizes = project_bytes(args.out, args.tokens, dims, every=args.project_every)
    else:
        write_synthetic_trace(args.out, args.tokens, dims, overwrite=True)
        sizes = trace_bytes(args.out)
        sizes["bytes_per_token"] = sizes["total"] / args.tokens
    print(json.dumps({k: round(v, 1) for k, v in sizes.items()}, indent=1))


if __name__ == "__main__":
    main()
