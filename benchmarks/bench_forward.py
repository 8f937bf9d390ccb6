"""Prefill speed and memory: our engine vs transformers on the same Kimi-Linear checkpoint.

A random `KimiLinearForCausalLM` (hidden 512, 8 layers, 2 of them MLA, 32 experts) is written once
with transformers' `save_pretrained` (experts as transformers stores them, fp32), then each
implementation runs one full causal forward over the same T = 4096 ids in a fresh subprocess:

- `engine`: `engine.load_model(dir)`;
- `transformers`: `KimiLinearForCausalLM.from_pretrained(dir)` with fla blocked (spec section 11)
  and eager attention / eager experts, its pure-PyTorch paths.

Each subprocess reports the forward's wall time and its peak RSS: the kernel's high-water mark is
reset right before the forward (`/proc/self/clear_refs`), so the peak covers the forward with the
weights already resident; `ru_maxrss` is the fallback. Both sides use the same thread count.
The last positions' logits of both runs are compared, so both computed the same function.

    python benchmarks/bench_forward.py                  # T = 4096, 1 thread
    python benchmarks/bench_forward.py --tokens 1024 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measure import peak_kb, reset_peak, status_kb

CONFIG = dict(
    vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
    num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=None, kv_lora_rank=256,
    qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, num_local_experts=32, num_experts_per_tok=4,
    n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, rms_norm_eps=1e-5,
    linear_attn_config={"head_dim": 128, "num_heads": 4, "short_conv_kernel_size": 4,
                        "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8]},
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
KEEP_LOGITS = 8  # last positions whose logits are compared between the two runs


def _block_fla() -> None:
    # transformers routes KDA to fla's Triton kernels when fla is importable; they need a GPU
    sys.modules["fla"] = None  # type: ignore[assignment]


def write_checkpoint(out: Path, seed: int, config: dict | None = None) -> None:
    """A random `KimiLinearForCausalLM` of `config` (default `CONFIG`) saved with transformers."""
    _block_fla()
    import torch
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(KimiLinearConfig(**(config or CONFIG), initializer_range=0.04)).eval()
    with torch.no_grad():  # non-trivial norms and selection bias, as in the oracle test
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(out)


def worker(impl: str, ckpt: Path, tokens: int, threads: int, repeat: int, out: Path) -> None:
    """One implementation, one process: load, forward `repeat` times, report the best and the peak."""
    if impl == "transformers":
        _block_fla()
    import torch

    torch.set_num_threads(threads)
    if impl == "engine":
        from engine import load_model

        model = load_model(ckpt)
        run = lambda ids: model(ids)  # noqa: E731
    else:
        from transformers import KimiLinearForCausalLM

        model = KimiLinearForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager",
                                                      experts_implementation="eager").eval()
        run = lambda ids: model(input_ids=ids, use_cache=False).logits  # noqa: E731
    ids = torch.randint(0, CONFIG["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(0))
    rss_before = status_kb("VmRSS")
    peak_reset = reset_peak()
    times, cpu_times = [], []
    with torch.no_grad():
        for _ in range(repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            logits = run(ids)
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
    peak = peak_kb(peak_reset)
    from safetensors.torch import save_file

    save_file({"logits": logits[0, -KEEP_LOGITS:].float().contiguous()}, str(out.with_suffix(".logits.safetensors")))
    out.write_text(json.dumps({"impl": impl, "seconds": min(times), "all_seconds": times, "cpu_seconds": min(cpu_times),
                               "rss_before_kb": rss_before, "peak_kb": peak, "peak_reset": peak_reset}))


def run_worker(impl: str, ckpt: Path, args: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / f"{impl}.json"
    cmd = [sys.executable, __file__, "--worker", impl, "--checkpoint", str(ckpt), "--tokens", str(args.tokens),
           "--threads", str(args.threads), "--repeat", str(args.repeat), "--result", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    subprocess.run(cmd, check=True, env=env, cwd=Path(__file__).resolve().parents[1])
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    # one thread by default: on a shared 2-core machine two OpenMP threads stall on each other's
    # barriers whenever a neighbour's process takes a core, which swamps the comparison
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1, help="forward passes per process (best time is reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", type=Path, help="reuse a checkpoint directory (written if missing)")
    ap.add_argument("--only", choices=["engine", "transformers"], help="run one side only")
    ap.add_argument("--worker", choices=["engine", "transformers"], help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--write-checkpoint", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.write_checkpoint:
        write_checkpoint(args.write_checkpoint, args.seed)
        return
    if args.worker:
        worker(args.worker, args.checkpoint, args.tokens, args.threads, args.repeat, args.result)
        return

    with tempfile.TemporaryDirectory(prefix="bench-forward-") as tmp_name:
        tmp = Path(tmp_name)
        ckpt = args.checkpoint or tmp / "kimi-linear"
        if not (ckpt / "config.json").exists():
            print(f"writing the transformers checkpoint to {ckpt} ...", flush=True)
            # its own process: transformers with fla blocked never shares a process with the engine run
            subprocess.run([sys.executable, __file__, "--write-checkpoint", str(ckpt), "--seed", str(args.seed)],
                           check=True)
        impls = [args.only] if args.only else ["engine", "transformers"]
        results = {impl: run_worker(impl, ckpt, args, tmp) for impl in impls}

        print(f"\nprefill, T = {args.tokens}, {args.threads} threads, hidden {CONFIG['hidden_size']}, "
              f"{CONFIG['num_hidden_layers']} layers (MLA at {CONFIG['linear_attn_config']['full_attn_layers']}), "
              f"{CONFIG['num_local_experts']} experts top-{CONFIG['num_experts_per_tok']}, fp32")
        print(f"{'implementation':<14} {'wall s':>8} {'CPU s':>8} {'tok/s':>8} {'RSS before MB':>14} "
              f"{'peak MB':>9} {'forward +MB':>12}")
        for impl, r in results.items():
            extra = (r["peak_kb"] - r["rss_before_kb"]) / 1024
            print(f"{impl:<14} {r['seconds']:>8.2f} {r['cpu_seconds']:>8.2f} {args.tokens / r['seconds']:>8.0f} "
                  f"{r['rss_before_kb'] / 1024:>14.0f} {r['peak_kb'] / 1024:>9.0f} {extra:>12.0f}")
        if len(results) == 2:
            e, t = results["engine"], results["transformers"]
            from safetensors.torch import load_file

            le = load_file(str(tmp / "engine.logits.safetensors"))["logits"].double()
            lt = load_file(str(tmp / "transformers.logits.safetensors"))["logits"].double()
            print(f"\nspeed-up (transformers / engine): wall {t['seconds'] / e['seconds']:.2f}x, "
                  f"CPU {t['cpu_seconds'] / e['cpu_seconds']:.2f}x")
            print(f"peak RSS ratio (engine / transformers): {e['peak_kb'] / t['peak_kb']:.2f}")
            print(f"forward memory ratio (engine / transformers, peak minus RSS before): "
                  f"{(e['peak_kb'] - e['rss_before_kb']) / max(1, t['peak_kb'] - t['rss_before_kb']):.2f}")
            print(f"last {KEEP_LOGITS} positions' logits, relative error: {float((le - lt).norm() / lt.norm()):.2e} "
                  "(1e-6 scale unless an fp32 near-tie in expert routing let the two pick different experts)")


if __name__ == "__main__":
    main()
