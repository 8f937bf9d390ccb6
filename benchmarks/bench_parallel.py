"""Bytes communicated per token per layer at world 8, against the minimum of the chosen dispatch.

Launches 8 gloo ranks on this machine (the `tiny-tp` preset, fp32), counts every byte each rank
hands to a collective (`engine.parallel.comm`, tagged by call site) over a prefill and a few
decode steps, and divides by tokens and by the layers that make each call. The minimum of the
chosen MoE dispatch (route everywhere, combine with one all-reduce, see `engine.parallel.ep`) is
one latent row per token in the activation dtype; the ratio measured / minimum says whether the
engine moves anything beyond it. The same formulas then give the K3.1 Pro numbers (bf16), wire
bytes under a ring all-reduce, and the all-to-all alternative.

    python benchmarks/bench_parallel.py [--world 8] [--tokens 64] [--decode 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine import get_preset, load_model
from engine.config import ModelConfig
from engine.parallel import distributed, ep
from engine.parallel.mesh import CommStats
from engine.session import Session


def rank_main(args: argparse.Namespace) -> None:
    """One rank: run the workload with a byte counter; rank 0 writes the counts."""
    torch.set_num_threads(1)
    with distributed() as ctx:
        ctx = dataclasses.replace(ctx, stats=CommStats())
        model = load_model(f"preset:{args.preset}", parallel=ctx)
        ids = torch.randint(0, model.config.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))
        session = Session(model)
        session.append(ids=ids.tolist())
        generated = list(session.generate(max_new_tokens=args.decode + 1, temperature=0))
        if ctx.is_leader:
            counts = [{"op": op, "tag": tag, "calls": ctx.stats.calls[(op, tag)], "bytes": n}
                      for (op, tag), n in ctx.stats.nbytes.items()]
            tokens = args.tokens + len(generated) - 1  # the last sampled token is never fed back
            Path(args.out).write_text(json.dumps({"tokens": tokens, "counts": counts}))


def launch(args: argparse.Namespace) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp()) / "counts.json"
    procs = []
    for rank in range(args.world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank-main", "--out", str(out),
                                       "--preset", args.preset, "--tokens", str(args.tokens),
                                       "--decode", str(args.decode)], env=env))
    if any(p.wait() for p in procs):
        raise SystemExit("a rank failed")
    return json.loads(out.read_text())


def minimum_payload(config: ModelConfig, world: int, act_bytes: int) -> dict[str, int]:
    """Per tag: the fewest bytes per token per calling layer the chosen layout can hand to it."""
    h = config.hidden_size * act_bytes
    return {
        "attn.o_proj": h,  # row-parallel o_proj: one hidden row to sum
        "mlp": h,
        "moe.routed": config.expert_in_dim * act_bytes,  # the chosen dispatch: one latent row
        "moe.out": h,  # shared experts and the routed up-projection share this one
        "embed": h,
        "lm_head": config.vocab_size // world * act_bytes,  # this rank's logits, per logits row
    }


def layers_calling(config: ModelConfig, tag: str) -> int:
    n, dense = config.num_hidden_layers, config.first_k_dense_replace
    return {"attn.o_proj": n, "mlp": dense, "moe.routed": n - dense, "moe.out": n - dense}.get(tag, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--preset", default="tiny-tp")
    p.add_argument("--tokens", type=int, default=64, help="prompt tokens (one prefill)")
    p.add_argument("--decode", type=int, default=8, help="decode steps after the prefill")
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_main:
        rank_main(args)
        return
    started = time.perf_counter()
    result = launch(args)
    config, w = get_preset(args.preset), args.world
    minimum = minimum_payload(config, w, act_bytes=4)
    print(f"measured: {args.preset}, world {w}, gloo, fp32 activations, {result['tokens']} tokens "
          f"({args.tokens} prefill + {result['tokens'] - args.tokens} decode), {time.perf_counter() - started:.0f} s")
    print(f"{'collective':26s} {'calls':>6s} {'B/token/layer':>14s} {'minimum':>9s} {'ratio':>6s}")
    for c in sorted(result["counts"], key=lambda c: c["tag"]):
        per = c["bytes"] / result["tokens"] / layers_calling(config, c["tag"])
        floor = minimum[c["tag"]]
        if c["tag"] == "lm_head":  # the session asks for one logits row per forward call, not per token
            floor *= c["calls"] / result["tokens"]
        print(f"{c['op'] + ' ' + c['tag']:26s} {c['calls']:6d} {per:14.1f} {floor:9.1f} {per / floor:6.3f}")
    routed = next(c for c in result["counts"] if c["tag"] == "moe.routed")
    ratio = routed["bytes"] / result["tokens"] / layers_calling(config, "moe.routed") / minimum["moe.routed"]
    print(f"MoE dispatch+combine: measured / minimum of the chosen all-reduce dispatch = {ratio:.3f}")

    k3 = get_preset("k3.1-pro")
    a = 2  # bf16
    latent, hidden = k3.expert_in_dim * a, k3.hidden_size * a
    hit = ep.expected_ranks_per_token(k3.num_experts, k3.num_experts_per_token, w)
    remote = hit * (w - 1) / w
    print(f"\nK3.1 Pro, world {w}, bf16, per token per MoE layer (bytes):")
    print(f"  chosen: all-reduce of the latent ({k3.expert_in_dim}): payload {latent}, ring wire "
          f"{ep.ring_all_reduce_bytes(latent, w):,.0f} per rank = {w * ep.ring_all_reduce_bytes(latent, w):,.0f} "
          f"per node; floor (every rank receives the sum once) {latent}: ring/floor "
          f"{ep.ring_all_reduce_bytes(latent, w) / latent:.3f}")
    a2a = 2 * remote * latent
    regather = (w - 1) * hidden
    print(f"  all-to-all alternative: {hit:.2f} ranks hit per token ({remote:.2f} remote): dispatch + combine "
          f"{a2a:,.0f} per node, + re-replicating the hidden row for sharded attention {regather:,.0f} = "
          f"{a2a + regather:,.0f} ({(a2a + regather) / (w * ep.ring_all_reduce_bytes(latent, w)):.2f}x the chosen)")
    per_layer = 2 * ep.ring_all_reduce_bytes(hidden, w) + ep.ring_all_reduce_bytes(latent, w)
    print(f"  whole MoE layer incl. attention all-reduce: {per_layer:,.0f} wire bytes per rank per token "
          f"(attention {hidden}, routed {latent}, shared+up {hidden} payload)")


if __name__ == "__main__":
    main()
