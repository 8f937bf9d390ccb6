"""Attribution over the whole context on the trained demo model: where did the passcode come from?

    python benchmarks/bench_attribution.py                                  # 32K and 128K, needle at 3 depths
    python benchmarks/bench_attribution.py --lengths 4096 --depths 0.5 --kda-lengths 4096   # a quick run

For each context length and needle depth: the demo's documents (`workbench demo`'s wording and filler)
with the passcode sentence planted at that depth of the context (at a sentence end), the trained
question asked with the answer's prefix, and `workbench.attribute` run over the context's sentences
(DSA only; with `--kda-lengths`, also the KDA variant: writes over hidden spans suppressed). Printed per
row: the spans, how many the answer's DSA reads left as candidates, the needle span's rank, its exact
effect beside its 8 controls' range, the surrogate's LDS on held-out masks, and the attribution's time
beside one prefill of the same context measured in the same call (`Attribution.prefill_s`), as a ratio.
One CPU thread (OMP_NUM_THREADS=1 is set before torch loads).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import workbench  # noqa: E402
from prompts import demo_prompt, sweep  # noqa: E402
from workbench.retrieval_text import answer_style_of  # noqa: E402
from workbench.sessions import load_with_tokenizer  # noqa: E402


def needle_row(result, needle: tuple[int, int]) -> tuple[int, object]:
    """(1-based rank, span) of the span holding most of the needle."""
    def overlap(s):
        return max(0, min(s.end, needle[1]) - max(s.start, needle[0]))
    best = max(range(len(result.spans)), key=lambda i: overlap(result.spans[i]))
    return best + 1, result.spans[best]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:demo")
    p.add_argument("--lengths", default="32768,131072", help="context lengths, comma separated")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths (0..1), comma separated")
    p.add_argument("--kda-lengths", default="", help="lengths at which the KDA variant also runs (slow: each mask "
                   "re-runs the context from its earliest hidden span)")
    p.add_argument("--kda-depths", default="0.5", help="depths of the KDA variant's runs")
    p.add_argument("--spans", default="sentences", choices=("sentences", "paragraphs", "segments"))
    p.add_argument("--masks", type=int, default=64)
    p.add_argument("--holdout", type=int, default=16)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--controls", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    model, tokenizer = load_with_tokenizer(args.model)
    style = answer_style_of(args.model)
    plan = [(n, d, False) for n, d in sweep(args.lengths, args.depths)]
    plan += [(n, d, True) for n, d in sweep(args.kda_lengths, args.kda_depths)]
    rows = []
    print(f"{'tokens':>7} {'depth':>5} {'kda':>3} {'spans':>5} {'read':>5} {'rank':>4} {'effect':>8} "
          f"{'controls':>17} {'LDS':>5} {'attr s':>7} {'prefill s':>9} {'ratio':>5}  answer")
    for tokens, depth, kda in plan:
        prompt = demo_prompt(model, tokenizer, tokens, style, depth=depth)
        session, needle = prompt.session, prompt.needle
        t0 = time.perf_counter()
        result = workbench.attribute(session, continuation=prompt.ask, target=prompt.target, spans=args.spans, kda=kda,
                                     masks=args.masks, holdout=args.holdout, top=args.top, controls=args.controls,
                                     seed=args.seed, evidence=[needle])
        wall = time.perf_counter() - t0
        rank, span = needle_row(result, needle)
        ratio = result.attribution_s / result.prefill_s
        lds = "-" if result.lds is None else f"{result.lds:.2f}"
        controls = (f"{span.control_min:+.3f}..{span.control_max:+.3f}" if span.controls else "(not checked)")
        print(f"{len(session.tokens):>7} {depth:>5.2f} {'yes' if kda else 'no':>3} {len(result.spans):>5} "
              f"{result.candidates:>5} {rank:>4} {span.effect:>+8.3f} {controls:>17} {lds:>5} "
              f"{result.attribution_s:>7.1f} {result.prefill_s:>9.1f} {ratio:>5.2f}  {result.answer!r}", flush=True)
        rows.append({"tokens": len(session.tokens), "depth": depth, "kda": kda, "needle": list(needle),
                     "spans": len(result.spans), "candidates": result.candidates, "rank": rank,
                     "effect": span.effect, "control_min": span.control_min, "control_max": span.control_max,
                     "controls": span.controls, "verdict": span.verdict, "lds": result.lds,
                     "attribution_s": result.attribution_s, "prefill_s": result.prefill_s, "ratio": ratio,
                     "runs": result.runs, "wall_s": wall, "answer": result.answer, "right": result.right})
        del session, prompt, result
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
