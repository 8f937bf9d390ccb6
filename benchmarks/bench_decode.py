"""Decode speed on the demo preset at several context lengths, side by side in one run.

For each context length the session's state is filled directly (random latents, indexer keys and
KDA states of the right shapes) instead of prefilling, so a 128K context costs no prefill time;
decode cost does not depend on the cached values. Prints per-token latency and tokens/s; the DSA
indexer scan grows with context (O(T) per token) while KDA and the MoE do not.

    python benchmarks/bench_decode.py --contexts 1024 16384 131072 --tokens 16 [--modes eager compiled]

Columns: the eager forward, and the compiled decode step (`engine.decode.step`; its warm-up
column is the compile at that context's cache capacity, one per capacity), each as wall and as
CPU ms per token (one torch thread: on a shared machine the CPU column is the one to read).

Trees side by side (a regression hunt): `--trees /tmp/wt-OLD .` runs one worker process per tree
(PYTHONPATH at that tree, so each imports its own engine; make old trees with `git worktree add
/tmp/wt-HASH HASH`) and asks them in turn, the order alternating every round, for the same decode
(`--rounds`, each on a fresh session); prints each tree's best and median CPU ms per token and their
ratios to the first tree. Only the eager mode is timed this way unless --modes says otherwise.

    python benchmarks/bench_decode.py --trees /tmp/wt-b207398 . --contexts 4096 --tokens 32 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

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


def decode_ms(model, context: int, tokens: int, mode) -> tuple[float, float, float]:
    """(wall ms per decode token, CPU ms per decode token, seconds of the warm-up: the compile when
    compiled) at `context`. Per token: the decode step and the loop around it (sampling, the
    session's bookkeeping). CPU time is this process's (one torch thread: on a shared machine
    wall time mostly measures the neighbours; inductor's compile workers are not counted)."""
    model.runtime.compile = mode
    s = session_at(model, context)
    t0 = time.perf_counter()
    # n tokens = n - 1 decode forwards (the first comes from the previous logits): two warm-up steps,
    # the first of which compiles at this capacity
    list(s.generate(3, temperature=0, stop_ids=()))
    s.prefill()  # the last sampled token, so that the timed loop below holds decode steps only
    warm = time.perf_counter() - t0
    steps0 = s.deployment.decode_steps
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in s.generate(tokens, temperature=0, stop_ids=()):
        pass
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    steps = max(1, s.deployment.decode_steps - steps0)
    return 1000 * wall / steps, 1000 * cpu / steps, warm


def last_level_cache_bytes() -> int:
    """Size of the largest CPU cache sysfs reports (0 when unknown)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            pass
    return max(sizes, default=0)


def _sum_seconds(n: int, dtype: torch.dtype) -> float:
    buf = torch.ones(n, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return best


def read_floor_ms(model, context: int) -> tuple[float, float, float]:
    """(MB of DSA indexer keys a decode step at `context` must read, ms to read them from cache, ms to
    stream them from memory): the O(T) part of a decode step that no amount of overhead removal avoids.
    Bandwidths: the best of 5 `torch.sum`s over a buffer of the keys' size (it may sit in the last-level
    cache between sums: the best case), and over one larger than that cache (what the step gets when
    the rest of it evicts the keys between tokens; measured in the compiled step at 128K: the scan
    runs at about the streaming figure)."""
    from engine.decode.step import static_capacity

    dsa = model.config.dsa
    if dsa is None:
        return 0.0, 0.0, 0.0
    slots = static_capacity(context + 1, dsa.topk)
    dtype = next(model.parameters()).dtype  # the caches' dtype
    item = torch.empty((), dtype=dtype).element_size()
    nbytes = len(dsa.layers) * slots * dsa.head_dim * item  # every slot of every DSA layer's key buffer
    cached = _sum_seconds(nbytes // item, dtype)
    big = max(4 * nbytes, min(2 * last_level_cache_bytes(), 2 << 30))  # at most 2 GiB beyond the keys' own size
    streamed = _sum_seconds(big // item, dtype) * nbytes / big
    return nbytes / 1e6, 1000 * cached, 1000 * streamed


def _worker(model_name: str, threads: int) -> None:
    """One tree's side of --trees: answer each request line ({"context", "tokens", "mode"}) on stdin with
    one JSON line of (wall ms, cpu ms, warm-up s) per token, measured on a fresh session."""
    torch.set_num_threads(threads)
    model = load_model(model_name)
    setting = {"eager": False, "static": "static", "compiled": True}
    import engine

    print(json.dumps({"ready": str(Path(engine.__file__).parents[1])}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps(decode_ms(model, req["context"], req["tokens"], setting[req["mode"]])), flush=True)


def compare_trees(trees: list[str], args) -> None:
    """Interleaved rounds over worker processes, one per tree (see the module docstring)."""
    env_base = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    workers = []
    for tree in trees:
        root = str(Path(tree).resolve())
        env = dict(env_base, PYTHONPATH=root)
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", "--model", args.model,
                                 "--threads", str(args.threads)], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd=root)
        ready = json.loads(proc.stdout.readline())["ready"]
        if ready != root:  # an editable install shadowing PYTHONPATH would compare a tree with itself
            raise SystemExit(f"worker for {root} imported the engine from {ready}")
        workers.append(proc)
    cpu = {(t, c, m): [] for t in range(len(trees)) for c in args.contexts for m in args.modes}
    try:
        for r in range(args.rounds):
            order = list(range(len(trees)))
            if r % 2:
                order.reverse()
            for c in args.contexts:
                for m in args.modes:
                    for t in order:
                        workers[t].stdin.write(json.dumps({"context": c, "tokens": args.tokens, "mode": m}) + "\n")
                        workers[t].stdin.flush()
                        cpu[t, c, m].append(json.loads(workers[t].stdout.readline())[1])
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        for proc in workers:
            proc.stdin.close()
            proc.wait()
    print(f"{'tree':>28} {'context':>8} {'mode':>8} {'best cpu ms/tok':>15} {'median':>8} {'best / tree 1':>13} "
          f"{'median / tree 1':>15}")
    for c in args.contexts:
        for m in args.modes:
            base = cpu[0, c, m]
            for t, tree in enumerate(trees):
                x = cpu[t, c, m]
                print(f"{tree[-28:]:>28} {c:>8} {m:>8} {min(x):>15.3f} {statistics.median(x):>8.3f} "
                      f"{min(x) / min(base):>13.4f} {statistics.median(x) / statistics.median(base):>15.4f}")
    print(f"({args.rounds} interleaved rounds of {args.tokens} tokens, order alternating; process CPU time)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="preset:demo")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384, 131072])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "static", "compiled"],
                    help="eager forward, the static-shape step run eagerly, the compiled step")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (2 spinning threads on a shared 2-core "
                    "machine slow torch down many times)")
    ap.add_argument("--trees", nargs="+", help="source trees to compare side by side (worker processes, "
                    "interleaved rounds); the first is the baseline")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds with --trees")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(args.model, args.threads)
    if args.trees:
        if "--modes" not in sys.argv:
            args.modes = ["eager"]
        return compare_trees(args.trees, args)
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    setting = {"eager": False, "static": "static", "compiled": True}
    rows = []
    for context in args.contexts:
        rows.append((context, {m: decode_ms(model, context, args.tokens, setting[m]) for m in args.modes}))
    head = " ".join(f"{m + ' ms/tok':>18} {'cpu ms/tok':>10} {'warm-up s':>9}" for m in args.modes)
    both = {"eager", "compiled"} <= set(args.modes)
    print(f"{'context':>10} " + head + (f" {'speed-up (cpu)':>14}" if both else ""))
    for context, r in rows:
        line = f"{context:>10} " + " ".join(f"{r[m][0]:>18.2f} {r[m][1]:>10.2f} {r[m][2]:>9.1f}" for m in args.modes)
        if both:
            line += f" {r['eager'][1] / r['compiled'][1]:>13.2f}x"
        print(line)
    for m in args.modes:
        base_wall, base_cpu = rows[0][1][m][0], rows[0][1][m][1]
        print(f"{m}: latency ratio vs first context (wall / cpu): "
              + ", ".join(f"{c}: {r[m][0] / base_wall:.2f}x / {r[m][1] / base_cpu:.2f}x" for c, r in rows))
    # the floor of that ratio: reading every indexer key once per token at this process's bandwidth
    # (CPU time with one thread, where it is the figure to read; wall time with several)
    column = 1 if args.threads == 1 else 0
    first, base = rows[0][0], rows[0][1][args.modes[-1]][column]
    mb0, ms0, st0 = read_floor_ms(model, first)
    for context, r in rows[1:]:
        mb, ms, st = read_floor_ms(model, context)
        print(f"indexer keys read per token at {context}: {mb:.1f} MB, >= {ms:.2f} ms from cache ({mb / max(ms, 1e-9):.1f} "
              f"GB/s), {st:.2f} ms streamed from memory ({mb / max(st, 1e-9):.1f} GB/s; measured now); "
              f"{args.modes[-1]} ratio floor with free overhead: {(base - ms0 + ms) / base:.2f}x cached, "
              f"{(base - st0 + st) / base:.2f}x streamed (measured {r[args.modes[-1]][column] / base:.2f}x)")


if __name__ == "__main__":
    main()
