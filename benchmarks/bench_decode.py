"""Decode speed on the demo preset at several context lengths, side by side in one run.

For each context length the session's state is filled directly (random latents, indexer keys and
KDA states of the right shapes) instead of prefilling, so a 128K context costs no prefill time;
decode cost does not depend on the cached values. Prints per-token latency and tokens/s; the DSA
indexer scan grows with context (O(T) per token) while KDA and the MoE do not.

    python benchmarks/bench_decode.py --contexts 1024 16384 131072 --tokens 16
"""

from __future__ import annotations

import argparse
import time

import torch

from engine import load_model
from engine.cache import KDAState, MLACache
from engine.session import Session


def session_at(model, context: int, seed: int = 0) -> Session:
    g = torch.Generator().manual_seed(seed)
    s = Session(model)
    s.tokens = torch.randint(0, 256, (context,), generator=g).tolist()
    for layer in s.state.layers:
        if isinstance(layer, KDAState):
            layer.recurrent = torch.randn(layer.recurrent.shape, generator=g) * 0.1
        else:
            assert isinstance(layer, MLACache)
            layer.reserve(context + 64)
            layer.latent[:, :context] = torch.randn(layer.latent[:, :context].shape, generator=g)
            layer.k_rope[:, :context] = torch.randn(layer.k_rope[:, :context].shape, generator=g)
            if layer.index_keys is not None:
                layer.index_keys[:, :context] = torch.randn(layer.index_keys[:, :context].shape, generator=g)
    s.state.length = context
    s.last_logits = torch.zeros(model.config.vocab_size)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="preset:demo")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384, 131072])
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    model = load_model(args.model)
    rows = []
    for context in args.contexts:
        s = session_at(model, context)
        next(s.generate(1, temperature=0))  # warm-up step
        start = time.perf_counter()
        n = 0
        for t in s.generate(args.tokens, temperature=0, stop_ids=()):
            n += 1
        # generate's first token comes from the previous logits: n tokens = n - 1 decode forwards
        elapsed = time.perf_counter() - start
        steps = s.deployment.decode_steps
        ms = 1000 * s.deployment.decode_seconds / max(1, steps)
        rows.append((context, ms, 1000 / ms if ms else float("nan"), elapsed))
    print(f"{'context':>10} {'ms/token':>10} {'tokens/s':>10}")
    for context, ms, tps, _ in rows:
        print(f"{context:>10} {ms:>10.1f} {tps:>10.1f}")
    base = rows[0][1]
    print("latency ratio vs first context: " + ", ".join(f"{c}: {ms / base:.2f}x" for c, ms, _, _ in rows))


if __name__ == "__main__":
    main()
