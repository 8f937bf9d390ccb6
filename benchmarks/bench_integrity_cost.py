"""The integrity checks' share of a recorded decode, by attribution: the CPU time of the checks' own code,
measured where it runs, over the CPU time of the decode that carries it.

A/B timing of whole runs (health on against off, `bench_record.py --health-only`) cannot resolve 1% on a
shared 2-core machine: its per-round ratios spread over +-10-25%. So this script times only what the
checks add, in one recorded decode (builtin:demo's trained weights, eager CPU decode, the default policy
with its periodic flushes), and divides by the decode's CPU time:

- per step: the DSA tie band (`indexer_topk(..., ties=True)`, what it computes at once), timed against the
  same call without ties on the same inputs, in alternating order (the extra call is not part of the
  decode's time);
- at the flushes: the bulk-computed KDA, DSA and MoE fields (`engine.probes.Deferred` of the integrity
  functions and of the tie band of rows no tie decided), the three checkers that make the health rows, and the health tables' Parquet parts
  (on the writer's thread); thread CPU time in each.

The recording's close (its last flush) is included on both sides. With `--trees A B` the same
measurement runs on other git worktrees (each in its own process, alternating), for a before/after.

    python benchmarks/bench_integrity_cost.py --tokens 1024 --decode 512 --rounds 3 [--trees /tmp/wt-OLD .]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measure(tokens: int, decode: int) -> dict:
    """One recorded run in this process's tree; the health CPU by part and the decode's CPU."""
    import torch

    sys.path.insert(0, str(HERE))
    import workbench
    from engine import load_model
    from engine import probes
    from engine.layers import mla
    from engine.session import Session
    from engine.tokenizer import Tokenizer
    from measure import filler_ids
    from workbench.recorders import recorder as recorder_module
    from workbench.signals import integrity
    from workbench.trace import writer as writer_module

    torch.set_num_threads(1)
    cost = {"dsa_ties_per_step": 0.0, "deferred_fields": 0.0, "checkers": 0.0, "health_parquet": 0.0}
    import engine.ops.dsa.reference as dsa_reference
    import engine.ops.integrity as integrity_ops

    # the functions the layers defer (those a tree lacks are skipped: an older tree computes them per step)
    deferred_ids = {id(getattr(module, name)) for module, names in (
        (integrity_ops, ("frozen_channels", "unmeasured_drift", "router_logit_sums", "router_kth_choice",
                         "router_runner_up")),
        (dsa_reference, ("selection_tie_band", "no_tie_cut"))) for name in names if hasattr(module, name)}

    real_cat = recorder_module.cat_rows

    def cat_rows(parts, axis):
        if not (parts and isinstance(parts[0], probes.Deferred) and id(parts[0].fn) in deferred_ids):
            return real_cat(parts, axis)
        t0 = time.thread_time()
        try:
            return real_cat(parts, axis)
        finally:
            cost["deferred_fields"] += time.thread_time() - t0

    recorder_module.cat_rows = cat_rows

    def timed_checker(fn):
        def checker(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                cost["checkers"] += time.thread_time() - t0
        return checker

    integrity._CHECKERS = {name: timed_checker(fn) for name, fn in integrity._CHECKERS.items()}
    real_write = writer_module.write_parquet_atomic

    def write_parquet_atomic(table, path, *args, **kwargs):
        t0 = time.thread_time()
        try:
            return real_write(table, path, *args, **kwargs)
        finally:
            if Path(path).parent.name.endswith("_health"):
                cost["health_parquet"] += time.thread_time() - t0

    writer_module.write_parquet_atomic = write_parquet_atomic
    real_topk = mla.indexer_topk
    flip = [False]

    def indexer_topk(*args, ties=False, **kwargs):
        if not ties:
            return real_topk(*args, **kwargs)
        # the same call without ties, before or after (alternating): the difference is the tie band's cost
        flip[0] = not flip[0]
        if flip[0]:
            t0 = time.thread_time(); real_topk(*args, **kwargs); plain = time.thread_time() - t0
            t0 = time.thread_time(); out = real_topk(*args, ties=True, **kwargs); tied = time.thread_time() - t0
        else:
            t0 = time.thread_time(); out = real_topk(*args, ties=True, **kwargs); tied = time.thread_time() - t0
            t0 = time.thread_time(); real_topk(*args, **kwargs); plain = time.thread_time() - t0
        if measuring[0]:
            cost["dsa_ties_per_step"] += tied - plain
            extra[0] += plain
        return out

    measuring, extra = [False], [0.0]
    mla.indexer_topk = indexer_topk
    model = load_model("builtin:demo")
    model.runtime.compile = False
    tok = Tokenizer.byte_level()
    ids = filler_ids(tokens, tok.encode)
    trace = Path(tempfile.mkdtemp(prefix="bench-integrity-")) / "t"
    session = Session(model, tok, prefill_chunk=2048, progress=False)
    session.append(ids=ids, name="document")
    with workbench.record(session, trace=trace):
        session.prefill()
        for key in cost:
            cost[key] = 0.0
        measuring[0] = True
        cpu0 = time.process_time()
        steps = sum(1 for _ in session.generate(decode, temperature=0, stop_ids=()))
    cpu = time.process_time() - cpu0 - extra[0]  # the decode and its close, less the extra untied calls
    shutil.rmtree(trace.parent, ignore_errors=True)
    return {"steps": steps, "decode_cpu_s": cpu, **cost}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trees", nargs="*", default=None, help="git worktrees to measure (default: this one)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process: one run, JSON out
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.tokens, args.decode)))
        return
    trees = [Path(t).resolve() for t in (args.trees or [HERE.parent])]
    results: dict[Path, list[dict]] = {t: [] for t in trees}
    for round_no in range(args.rounds):
        for tree in trees if round_no % 2 == 0 else trees[::-1]:
            env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
            out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one", "--tokens",
                                  str(args.tokens), "--decode", str(args.decode)],
                                 cwd=tree, env=env, capture_output=True, text=True, check=True)
            results[tree].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"builtin:demo, {args.tokens}-token prefill, {args.decode} eager decode steps recorded with the default "
          f"policy (periodic flushes and the close included); CPU ms per decode step, median of {args.rounds} runs")
    parts = ("dsa_ties_per_step", "deferred_fields", "checkers", "health_parquet")
    print(f"{'tree':<28} {'decode':>8} " + " ".join(f"{p:>18}" for p in parts) + f" {'integrity share':>16}")
    for tree, runs in results.items():
        def med(key: str) -> float:
            values = sorted(r[key] / r["steps"] * 1e3 for r in runs)
            return values[len(values) // 2]
        shares = sorted(sum(r[p] for p in parts) / r["decode_cpu_s"] for r in runs)
        print(f"{str(tree)[-28:]:<28} {med('decode_cpu_s'):>8.3f} " + " ".join(f"{med(p):>18.4f}" for p in parts)
              + f" {shares[len(shares) // 2]:>+15.2%} (runs {shares[0]:+.2%} .. {shares[-1]:+.2%})")


if __name__ == "__main__":
    main()
