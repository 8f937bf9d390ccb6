"""Vectorised signal models behind `k3testing.synthetic`: what DSA, KDA and MoE recorders would emit.

Each model draws its per-layer character once (local window, sink eviction, needle reading; KDA
time constants and forgetful heads; expert popularity, image experts, a hot expert-parallel rank)
and then produces one window of rows at a time (a prefill chunk or a run of decode steps) with
numpy only, so a 1M-token trace at full K3.1 Pro dimensions takes seconds, not hours.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Window:
    """Queries [start, end) processed together; `steps` [end - start] is the step of each query."""

    start: int
    end: int
    steps: np.ndarray
    decode: bool


class DSAModel:
    """Top-k selection = sinks + a local window + the needle (some layers, while answering) + far keys
    drawn log-uniformly in distance. One layer stops hitting the sink halfway through the prompt."""

    def __init__(self, rng: np.random.Generator, layers: tuple[int, ...], topk: int, sink: int,
                 needle: tuple[int, int], evict_at: int) -> None:
        self.rng = rng
        self.layers = layers
        self.topk = topk
        self.sink = sink
        self.needle = needle
        n = len(layers)
        self.local = np.maximum(topk // 8, (topk * rng.uniform(0.15, 0.45, n)).astype(np.int64))
        self.needle_layers = tuple(l for i, l in enumerate(layers) if i % 3 == 0)
        self.evict_layer = layers[-1]
        self.evict_at = evict_at
        self.mass_scale = rng.uniform(0.02, 0.08, n)

    def _sink_on(self, layer: int, q: np.ndarray) -> np.ndarray:
        return ~((layer == self.evict_layer) & (q >= self.evict_at))

    def select(self, i: int, q: np.ndarray, decode: bool) -> np.ndarray:
        """Selected key positions [len(q), topk] int32, ascending, -1 where padded."""
        layer, k, rng = self.layers[i], self.topk, self.rng
        n = len(q)
        q64 = q.astype(np.int64)[:, None]
        if n == 0:
            return np.zeros((0, k), np.int32)
        w = int(self.local[i])
        sinks = np.where(self._sink_on(layer, q)[:, None], np.arange(self.sink)[None, :], -1)
        local = q64 - np.arange(w)[None, :]
        parts = [sinks, local]
        if decode and layer in self.needle_layers:
            lo, hi = self.needle
            parts.append(np.broadcast_to(np.arange(lo, hi)[None, :], (n, hi - lo)))
        far_n = k - sum(p.shape[1] for p in parts)
        span = np.maximum(q64 - self.sink, w + 1).astype(np.float64)
        u = rng.random((n, far_n))
        far = q64 - np.floor(np.exp(np.log(w) + u * (np.log(span) - np.log(w)))).astype(np.int64)
        sel = np.sort(np.concatenate(parts + [far], axis=1), axis=1)
        sel[:, 1:][sel[:, 1:] == sel[:, :-1]] = -1
        sel[(sel < 0) | (sel > q64)] = -1
        short = q < k
        if short.any():
            # fewer past keys than k: DSA keeps them all
            full = np.arange(k)[None, :]
            sel[short] = np.where(full <= q64[short], full, -1)
        return sel.astype(np.int32)

    def density(self, i: int, window: Window, n_bins: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """Expected selections per query: (per key bin [n_bins], per log2 distance bin [32]) at the window's middle."""
        layer, k = self.layers[i], self.topk
        q = (window.start + window.end - 1) // 2
        edges = np.arange(n_bins + 1, dtype=np.float64) * width
        per_bin = np.zeros(n_bins)
        per_dist = np.zeros(32)
        if q < k:
            per_bin = np.clip(np.minimum(edges[1:], q + 1) - edges[:-1], 0, None)
            d = np.arange(q + 1)
            np.add.at(per_dist, np.floor(np.log2(d + 1.0)).astype(np.int64), 1.0)
            return per_bin, per_dist
        w = int(self.local[i])
        parts_used = w
        if self._sink_on(layer, np.array([q]))[0]:
            per_bin[0] += self.sink
            per_dist[int(np.log2(q + 1))] += self.sink
            parts_used += self.sink
        per_bin += np.clip(np.minimum(edges[1:], q + 1) - np.maximum(edges[:-1], q - w + 1), 0, None)
        d = np.arange(w)
        np.add.at(per_dist, np.floor(np.log2(d + 1.0)).astype(np.int64), 1.0)
        if window.decode and layer in self.needle_layers:
            lo, hi = self.needle
            per_bin += np.clip(np.minimum(edges[1:], hi) - np.maximum(edges[:-1], lo), 0, None)
            per_dist[int(np.log2(q - lo + 1))] += hi - lo
            parts_used += hi - lo
        far_n = k - parts_used
        span = max(q - self.sink, w + 1)
        # far keys: distance log-uniform on [w, span]; bin [x0, x1) holds distances (q - x1, q - x0]
        d_hi = np.clip(q - edges[:-1], w, span)
        d_lo = np.clip(q - edges[1:], w, span)
        per_bin += far_n * (np.log(d_hi) - np.log(d_lo)) / (np.log(span) - np.log(w))
        b_lo = np.clip(np.exp2(np.arange(32)) - 1, w, span)
        b_hi = np.clip(np.exp2(np.arange(1, 33)) - 1, w, span)
        per_dist += far_n * (np.log(b_hi) - np.log(b_lo)) / (np.log(span) - np.log(w))
        return per_bin, per_dist

    def sink_rate(self, i: int, q: np.ndarray) -> np.ndarray:
        return np.where(self._sink_on(self.layers[i], q) | (q < self.topk), 0.995, 0.03)

    def dense_mass(self, i: int, q: np.ndarray) -> np.ndarray:
        base = 1.0 - self.mass_scale[i] * np.log2(1.0 + q / self.topk)
        return np.clip(base + self.rng.normal(0, 0.01, len(q)), 0.2, 1.0).astype(np.float32)


class KDAModel:
    """State norm of head h: amp_h * sqrt(1 - exp(-t / tau_h)), t = tokens since the start, or since the
    current segment for forgetful heads (their state is washed out by each new document or image)."""

    def __init__(self, rng: np.random.Generator, layers: tuple[int, ...], heads: int, horizon: int,
                 segment_starts: np.ndarray) -> None:
        self.rng = rng
        self.layers = layers
        n = len(layers)
        self.tau = np.exp(rng.uniform(np.log(64), np.log(max(horizon, 128)), (n, heads)))
        self.amp = rng.uniform(4.0, 40.0, (n, heads))
        self.forgetful = rng.random((n, heads)) < 0.1
        self.beta = rng.uniform(0.2, 0.8, (n, heads))
        self.segment_starts = np.asarray(segment_starts)

    def stats(self, i: int, pos: np.ndarray) -> dict[str, np.ndarray]:
        """norm, max_abs, mean_decay, mean_beta: float16 [len(pos), heads] each."""
        seg_start = self.segment_starts[np.searchsorted(self.segment_starts, pos, side="right") - 1]
        t_all = pos[:, None].astype(np.float64) + 1
        t_seg = (pos - seg_start)[:, None].astype(np.float64) + 1
        t = np.where(self.forgetful[i][None, :], t_seg, t_all)
        noise = self.rng.normal(1.0, 0.01, t.shape)
        norm = self.amp[i] * np.sqrt(1.0 - np.exp(-t / self.tau[i])) * noise
        decay = np.exp(-1.0 / self.tau[i]) * np.ones_like(norm)
        return {"norm": norm.astype(np.float16), "max_abs": (norm * 0.05).astype(np.float16),
                "mean_decay": decay.astype(np.float16),
                "mean_beta": (self.beta[i] * noise).astype(np.float16)}


class MoEModel:
    """Router logits per layer: a shared popularity profile, a block of image experts boosted for image
    tokens, and one expert-parallel rank whose experts are slightly favoured (an overloaded rank)."""

    def __init__(self, rng: np.random.Generator, layers: tuple[int, ...], experts: int, top: int,
                 ep_ranks: int) -> None:
        self.rng = rng
        self.layers = layers
        self.experts = experts
        self.top = top
        self.ep_ranks = ep_ranks
        n = len(layers)
        logits = rng.normal(0.0, 1.0, (n, experts))
        per_rank = experts // ep_ranks
        self.hot_rank = ep_ranks - 1 if ep_ranks > 1 else 0
        if ep_ranks > 1:
            logits[:, self.hot_rank * per_rank:(self.hot_rank + 1) * per_rank] += 0.4
        self.image_experts = np.sort(rng.choice(experts, max(1, experts // 16), replace=False))
        image = logits.copy()
        image[:, self.image_experts] += 3.0
        self.logits = {"text": logits, "image": image}
        self.probs = {m: _softmax(v) for m, v in self.logits.items()}

    def routes(self, i: int, modality: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """experts int16 [n, top], weights float16 [n, top], entropy float32 [n] for tokens of `modality`."""
        n = len(modality)
        base = np.where((modality == "image")[:, None], self.logits["image"][i], self.logits["text"][i])
        # per-token router noise; float32 normals are ~10x cheaper than Gumbel draws at 896 experts
        noisy = base.astype(np.float32) + self.rng.standard_normal((n, self.experts), dtype=np.float32) * 0.7
        experts = np.argpartition(-noisy, self.top - 1, axis=1)[:, :self.top]
        picked = np.take_along_axis(noisy, experts, axis=1)
        order = np.argsort(-picked, axis=1)
        experts = np.take_along_axis(experts, order, axis=1)
        weights = _softmax(np.take_along_axis(picked, order, axis=1))
        p = _softmax(noisy)
        entropy = -(p * np.log(np.maximum(p, 1e-30))).sum(axis=1)
        return experts.astype(np.int16), weights.astype(np.float16), entropy.astype(np.float32)

    def counts(self, modality: str, tokens: int) -> np.ndarray:
        """Routed slots per expert for `tokens` tokens on every layer: int64 [layers, experts]."""
        return self.rng.multinomial(tokens * self.top, self.probs[modality])

    def rank_of(self) -> np.ndarray:
        return np.arange(self.experts) // max(1, self.experts // self.ep_ranks)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)
