"""Decode speed on the demo preset at several context lengths, side by side in one run.

For each context length the session's state is filled directly (random latents, indexer keys and
KDA states of the right shapes) instead of prefilling, so a 128K context costs no prefill time;
decode cost does not depend on the cached values. Prints per-token latency and tokens/s; the DSA
indexer scan grows with context (O(T) per token) while KDA and the MoE do not.

    python benchmarks/bench_decode.py --contexts 1024 16384 131072 --tokens 16 [--modes eager compiled]

Columns: the eager forward, and the compiled decode step (`engine.decode_step`; its warm-up
column is the compile at that context's cache capacity, one per capacity).
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


def decode_ms(model, context: int, tokens: int, mode) -> tuple[float, float]:
    """(ms per decode step, seconds of the warm-up step: the compile when compiled) at `context`."""
    model.runtime.compile = mode
    s = session_at(model, context)
    t0 = time.perf_counter()
    # n tokens = n - 1 decode forwards (the first comes from the previous logits): two warm-up steps,
    # the first of which compiles at this capacity
    list(s.generate(3, temperature=0, stop_ids=()))
    warm = time.perf_counter() - t0
    steps0, seconds0 = s.deployment.decode_steps, s.deployment.decode_seconds
    for _ in s.generate(tokens, temperature=0, stop_ids=()):
        pass
    steps = s.deployment.decode_steps - steps0
    return 1000 * (s.deployment.decode_seconds - seconds0) / max(1, steps), warm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="preset:demo")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384, 131072])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "static", "compiled"],
                    help="eager forward, the static-shape step run eagerly, the compiled step")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (2 spinning threads on a shared 2-core "
                    "machine slow torch down many times)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    setting = {"eager": False, "static": "static", "compiled": True}
    rows = []
    for context in args.contexts:
        rows.append((context, {m: decode_ms(model, context, args.tokens, setting[m]) for m in args.modes}))
    print(f"{'context':>10} " + " ".join(f"{m + ' ms/tok':>18} {'warm-up s':>9}" for m in args.modes)
          + (f" {'speed-up':>9}" if {"eager", "compiled"} <= set(args.modes) else ""))
    for context, r in rows:
        line = f"{context:>10} " + " ".join(f"{r[m][0]:>18.2f} {r[m][1]:>9.1f}" for m in args.modes)
        if {"eager", "compiled"} <= set(args.modes):
            line += f" {r['eager'][0] / r['compiled'][0]:>8.2f}x"
        print(line)
    for m in args.modes:
        base = rows[0][1][m][0]
        print(f"{m}: latency ratio vs first context: "
              + ", ".join(f"{c}: {r[m][0] / base:.2f}x" for c, r in rows))


if __name__ == "__main__":
    main()
