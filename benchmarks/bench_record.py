"""Cost of recording, side by side in one run on the demo preset: off, default policy, `all`, and each
opt-in measure on top of the default policy (kda-rank: effective rank every 256 tokens; kda-extras:
max |S|, mean decay / beta, half-lives; overlap: dense top-k IoU / recall beside each dense-mass query).

For each mode the same session (N-token prefill in chunks, then D greedy decode steps) runs; modes
alternate over `--repeats` rounds and the best time of each is kept (the whole run's and, on its own,
the decode steps'), so a noisy machine biases all modes alike. Prints tokens/s, the overhead against recording off, and trace bytes per token; then
the projected size of a default-policy trace per 1M tokens at full K3.1 Pro dimensions (written
with the trace store's synthetic generator at every 24th layer and scaled to all layers).

    python benchmarks/bench_record.py --tokens 16384 --decode 32 [--compile off|static|on]

The decode overhead is printed on its own (decode tok/s against recording off), beside the
whole-run overhead that prefill dominates. `--compile` sets `runtime.compile` for every mode; with
`on`, listeners collect inside the compiled decode step (`engine.decode.step`), except those of
policies asking for the KDA effective rank or half-lives (`all`, `kda-rank`, `kda-extras`), whose
decode steps run the eager forward and so pay the compiled step's whole speed-up as overhead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

# the synthetic-trace harness is test scaffolding at the repository root, not an installed package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k3testing.synthetic import Dims, Policy, project_bytes, trace_bytes  # noqa: E402

import torch

import workbench
from engine import load_model
from engine.session import Session
from engine.tokenizer import Tokenizer
from measure import filler_ids
from workbench.recorders.policy import RecordPolicy


def run(model, ids: list[int], decode: int, chunk: int, policy: "str | RecordPolicy | None", trace: Path) -> dict:
    session = Session(model, Tokenizer.byte_level(), prefill_chunk=chunk, progress=False)
    session.append(ids=ids, name="document")
    if policy is not None:
        shutil.rmtree(trace, ignore_errors=True)
    recording = workbench.record(session, trace=trace, policy=policy) if policy else contextlib.nullcontext()
    with recording:
        start, cpu_start = time.perf_counter(), time.process_time()
        session.prefill()
        mid, cpu_mid = time.perf_counter(), time.process_time()
        for _ in session.generate(decode, temperature=0, stop_ids=()):
            pass
        end, cpu_end = time.perf_counter(), time.process_time()
    closed = time.perf_counter()  # the recording's close: its last flush (decode payloads are reduced there)
    # generation may end early on the end-of-message token: count the decode steps that ran
    rec = session.deployment
    return {"prefill_s": mid - start, "decode_s": rec.decode_seconds, "decode_steps": rec.decode_steps,
            "total_s": end - start, "close_s": closed - end, "tokens": len(session.tokens),
            # this process's CPU seconds: on a shared machine, time spent descheduled is left out
            "prefill_cpu_s": cpu_mid - cpu_start, "decode_cpu_s": cpu_end - cpu_mid,
            "bytes": trace_bytes(trace)["total"] if policy is not None else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-projection", action="store_true")
    ap.add_argument("--skip-opt-in", action="store_true", help="only off / default / all")
    ap.add_argument("--compile", choices=["off", "static", "on"], default="off")
    ap.add_argument("--health-only", action="store_true", help="only off / default / no-health: the integrity "
                    "checks' cost (issue 41), per round")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (2 spinning threads on a shared 2-core "
                    "machine slow torch down many times)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model("preset:demo")
    model.runtime.compile = {"off": False, "static": "static", "on": True}[args.compile]
    ids = filler_ids(args.tokens, Tokenizer.byte_level().encode)
    tmp = Path(tempfile.mkdtemp(prefix="bench-record-"))
    modes = {"off": None, "default": "default", "no-health": RecordPolicy(name="no-health", health=False), "all": "all"}
    if args.health_only:
        modes = {"off": None, "default": "default", "no-health": modes["no-health"]}
    elif not args.skip_opt_in:
        modes.update({"kda-rank": RecordPolicy(name="kda-rank", kda_rank_every=256),
                      "kda-extras": RecordPolicy(name="kda-extras", kda_extras=True),
                      "overlap": RecordPolicy(name="overlap", dense_overlap=True, dense_mass_stride=256)})
    best: dict[str, dict] = {}
    best_decode: dict[str, float] = {}  # seconds per decode step: the best round of each mode on its own
    health_ratios: list[tuple[float, float]] = []  # per round: default / no-health, decode step and prefill
    for round_no in range(args.repeats):
        this_round: dict[str, dict] = {}
        order = list(modes.items())
        for name, policy in order if round_no % 2 == 0 else order[::-1]:  # alternate who runs first
            r = this_round[name] = run(model, ids, args.decode, args.chunk, policy, tmp / name)
            if name not in best or r["total_s"] < best[name]["total_s"]:
                best[name] = r
            per_step = r["decode_s"] / max(1, r["decode_steps"])
            best_decode[name] = min(best_decode.get(name, per_step), per_step)
        on, off_checks = this_round["default"], this_round["no-health"]
        health_ratios.append((on["decode_cpu_s"] / max(1, on["decode_steps"]) / (off_checks["decode_cpu_s"] / max(
            1, off_checks["decode_steps"])), on["prefill_cpu_s"] / off_checks["prefill_cpu_s"]))
    off = best["off"]
    print(f"demo preset, {args.tokens}-token prefill (chunks of {args.chunk}) + {args.decode} decode steps, "
          f"best of {args.repeats}, torch threads {torch.get_num_threads()}, compile {args.compile}")
    print(f"{'mode':>8} {'prefill tok/s':>14} {'decode tok/s':>13} {'decode overhead':>16} {'overhead':>9} "
          f"{'trace bytes/token':>18} {'close ms':>9}")

    for name, r in best.items():
        overhead = r["total_s"] / off["total_s"] - 1
        print(f"{name:>8} {args.tokens / r['prefill_s']:>14.1f} {1 / best_decode[name]:>13.1f} "
              f"{best_decode[name] / best_decode['off'] - 1:>+15.1%} {overhead:>+8.1%} {r['bytes'] / r['tokens']:>18.1f}"
              f" {r['close_s'] * 1e3:>9.1f}")
    print("(close ms: the recording's final flush after the timed run, where payloads of the decode steps since "
          "the last periodic flush are reduced and written; not in the overheads)")
    decode_ratios = sorted(d for d, _ in health_ratios)
    prefill_ratios = sorted(p for _, p in health_ratios)
    print(f"integrity checks (default policy against the same with health off, rounds interleaved; CPU time): "
          f"decode step {best_decode['default'] / best_decode['no-health'] - 1:+.2%} wall best against best, "
          f"CPU per round median "
          f"{decode_ratios[len(decode_ratios) // 2] - 1:+.2%} (range {decode_ratios[0] - 1:+.2%} .. "
          f"{decode_ratios[-1] - 1:+.2%}); prefill per round median "
          f"{prefill_ratios[len(prefill_ratios) // 2] - 1:+.2%} (range {prefill_ratios[0] - 1:+.2%} .. "
          f"{prefill_ratios[-1] - 1:+.2%})")
    per_token = best["default"]["bytes"] / best["default"]["tokens"]
    print(f"default-policy trace of a 128K-token demo session: {per_token * 131072 / 1e6:.1f} MB (goal < 200 MB)")
    if not args.skip_projection:
        d = RecordPolicy()
        policy = Policy(dsa_bin_tokens=d.dsa_bin_tokens, sink_tokens=d.sink_tokens,
                        dsa_prefill_stride=d.dsa_prefill_stride, kda_every=d.kda_every_tokens,
                        moe_window_every=d.moe_window_every, moe_window_len=d.moe_window_tokens)
        sizes = project_bytes(tmp / "projection", 1 << 20, Dims.k31_pro(), policy, every=24)
        print(f"projected default-policy trace at K3.1 Pro dims: {sizes['total'] / 1e9:.2f} GB per 1M tokens "
              f"({sizes['bytes_per_token']:.0f} B/token; goal <= 1.5 GB)")
        print(json.dumps({k: round(v / 1e6, 1) for k, v in sizes.items() if k not in ("bytes_per_token",)},
                         indent=None))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
