"""Eager MLA latent attention per call (`engine.ops.mla.reference.dense_attention_latent`), trees side by side.

One decode query (B = 1, Tq = 1) over a cache of each length, at the 4-head Kimi-Linear shape of
`bench_vs_llamacpp.py` (R = 256, Dr = 32) unless told otherwise. Each tree's `reference.py` is
loaded by path into this one process and the trees are called in turn, the order alternating
every round; a buffer larger than the last-level cache is summed before each call, as a decode
step's weights evict the cache between its MLA layers. Prints best and median ms per call and
their ratios to the first tree.

    python benchmarks/bench_mla_attention.py --trees /tmp/wt-OLD . --keys 4097 16385 --rounds 21
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch


def _load(tree: str, n: int):
    path = Path(tree).resolve() / "engine" / "ops" / "mla" / "reference.py"
    spec = importlib.util.spec_from_file_location(f"mla_reference_{n}", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.dense_attention_latent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=["."], help="source trees; the first is the baseline")
    ap.add_argument("--keys", type=int, nargs="+", default=[4097, 16385], help="cache lengths (query at the last)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--rank", type=int, default=256, help="kv_lora_rank R")
    ap.add_argument("--rope", type=int, default=32, help="qk_rope_head_dim Dr")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--evict-mb", type=int, default=64, help="buffer summed before each call (0: cache warm)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    fns = [_load(t, i) for i, t in enumerate(args.trees)]
    g = torch.Generator().manual_seed(0)
    evict = torch.ones(args.evict_mb * 2**18) if args.evict_mb else None
    print(f"{'tree':>28} {'keys':>7} {'best ms':>8} {'median':>8} {'best / tree 1':>13} {'median / tree 1':>15}")
    for keys in args.keys:
        q_lat = torch.randn(1, 1, args.heads, args.rank, generator=g)
        q_rope = torch.randn(1, 1, args.heads, args.rope, generator=g)
        c = torch.randn(1, keys, args.rank, generator=g)
        k_r = torch.randn(1, keys, args.rope, generator=g)
        pos = torch.tensor([keys - 1])
        times: list[list[float]] = [[] for _ in fns]
        for r in range(args.rounds):
            order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
            for i in order:
                if evict is not None:
                    evict.sum()
                t0 = time.perf_counter()
                fns[i](q_lat, q_rope, c, k_r, pos, 0.1)
                times[i].append(1000 * (time.perf_counter() - t0))
        base = times[0]
        for tree, x in zip(args.trees, times):
            print(f"{tree[-28:]:>28} {keys:>7} {min(x):>8.3f} {statistics.median(x):>8.3f} "
                  f"{min(x) / min(base):>13.3f} {statistics.median(x) / statistics.median(base):>15.3f}")
    print(f"({args.rounds} interleaved rounds, one thread, wall time of each call)")


if __name__ == "__main__":
    main()
