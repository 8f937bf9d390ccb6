"""Held-out needle accuracy of the trained demo model: lengths x depths, sparse (as trained) vs dense.

    python benchmarks/bench_demo_model.py --model builtin:demo                  # 2K..128K, one table
    python benchmarks/bench_demo_model.py --model DIR --lengths 2048,8192 --samples 8,4

Runs the real path: `engine.load_model` on the checkpoint directory (MXFP4 experts), a `Session`
with chunked prefill, then the expected assistant response teacher-forced (`Session.feed`): the
answer is exactly right when every one of its tokens is the argmax after its prefix, which is when
greedy decoding would produce it. The same prompts are run with DSA sparse and with
`model.runtime.dsa_force_dense`, side by side.

While the answer tokens run, a sink on every DSA layer's `dsa.topk` probe counts the answer tokens
whose selected keys include at least one needle token, beside the exact chance of that for random
picks (`workbench.analysis.chance`). Prompts come from `training.text.HELD_OUT`: filler, key
names and needle wording the training generator never produces.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import load_model  # noqa: E402
from engine.builtin import is_builtin, resolve_builtin  # noqa: E402
from engine.session import Session  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from training.tasks import HELD_OUT, answer_ids, needle_prompt  # noqa: E402
from workbench.analysis.chance import chance_of_hit, format_read  # noqa: E402


def run_case(model, tok: Tokenizer, ids: list[int], plen: int, target: list[int], needle: tuple[int, int],
             chunk: int) -> dict:
    """One prompt: exact-answer check plus per-DSA-layer needle reads over the answer tokens."""
    session = Session(model, tok, prefill_chunk=chunk, progress=False)
    session.append(ids=ids[:plen], name="prompt")
    first = session.prefill()
    reads: dict[int, list[bool]] = {}
    chance: dict[int, list[float]] = {}
    topk = model.config.dsa.topk if model.config.dsa else 0

    def sink(point, payload) -> None:
        pos = payload["positions"]
        idx = payload["indices"][0]                       # [T, k]
        hit = ((idx >= needle[0]) & (idx < needle[1])).any(-1)
        reads.setdefault(point.layer, []).extend(hit.tolist())
        chance.setdefault(point.layer, []).extend(
            np.atleast_1d(chance_of_hit(pos.numpy() + 1, needle[1] - needle[0], topk)).tolist())

    points = [m.probe_topk for m in model.modules() if getattr(m, "indexer", None) is not None]
    for p in points:
        p.sink = sink
    try:
        # the answer's first token comes after the prompt; the query positions of the answer tokens
        # are the prompt's last position and the forced tokens before the last
        logits = session.feed(target[:-1], name="answer")
    finally:
        for p in points:
            p.sink = None
    pred = [int(first.argmax())] + logits.argmax(-1).tolist()
    layers = {}
    for layer in reads:
        r = np.array(reads[layer], dtype=float)
        layers[layer] = {"read": float(r.mean()), "chance": float(np.mean(chance[layer]))}
    return {"correct": pred == target, "layers": layers}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:demo")
    p.add_argument("--lengths", default="2048,8192,32768,65536,131072")
    p.add_argument("--samples", default="8,6,4,2,1", help="prompts per depth for each length")
    p.add_argument("--depths", default="0.1,0.5,0.9")
    p.add_argument("--modes", default="sparse,dense")
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=99)
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = resolve_builtin(args.model) if is_builtin(args.model) else Path(args.model)
    model = load_model(path)
    tok = Tokenizer.for_model(path, model.config.vocab_size)
    lengths = [int(x) for x in args.lengths.split(",")]
    counts = [int(x) for x in args.samples.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    modes = args.modes.split(",")
    rows = []
    print(f"model {path} (DSA top-k {model.config.dsa.topk}); held-out needle prompts; exact answer", flush=True)
    for li, length in enumerate(lengths):
        n = counts[min(li, len(counts) - 1)]
        for depth in depths:
            rng = random.Random(args.seed * 7919 + length * 31 + int(depth * 100))
            cases = []
            for _ in range(n):
                s = needle_prompt(tok, HELD_OUT, rng, length, depth)
                before, ans, after = answer_ids(tok, s.answer)
                target = before + ans + after[:1]
                cases.append((s.ids[: s.prompt_len] + target, s.prompt_len, target, (s.facts[0].start, s.facts[0].end)))
            for mode in modes:
                model.runtime.dsa_force_dense = mode == "dense"
                started = time.perf_counter()
                results = [run_case(model, tok, ids, plen, target, needle, args.prefill_chunk)
                           for ids, plen, target, needle in cases]
                good = [r for r in results if r["correct"]]
                best = None
                for layer in sorted({la for r in good for la in r["layers"]}):
                    read = float(np.mean([r["layers"][layer]["read"] for r in good]))
                    ch = float(np.mean([r["layers"][layer]["chance"] for r in good]))
                    if best is None or read / max(ch, 1e-12) > best[1] / max(best[2], 1e-12):
                        best = (layer, read, ch)
                row = {"length": length, "depth": depth, "mode": mode, "correct": len(good), "total": n,
                       "seconds": round(time.perf_counter() - started, 1),
                       "best_layer": None if best is None else best[0],
                       "best_read": None if best is None else best[1], "best_chance": None if best is None else best[2]}
                rows.append(row)
                reads = "" if best is None else f"; layer {best[0]}: {format_read(best[1], best[2])}"
                print(f"{length:>7,} tokens depth {depth:.0%} {mode:6s}: {len(good)}/{n} correct "
                      f"({row['seconds']:.0f} s){reads}", flush=True)
    model.runtime.dsa_force_dense = False
    print("\naccuracy (correct/total), held-out needle; sparse = DSA as trained, dense = dsa_force_dense")
    header = "| tokens | " + " | ".join(f"{m} {d:.0%}" for m in modes for d in depths) + " |"
    print(header)
    print("|---:|" + "---:|" * (len(modes) * len(depths)))
    for length in lengths:
        cells = []
        for m in modes:
            for d in depths:
                r = next(r for r in rows if r["length"] == length and r["mode"] == m and r["depth"] == d)
                cells.append(f"{r['correct']}/{r['total']}")
        print(f"| {length:,} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
