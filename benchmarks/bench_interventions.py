"""Causal check of the trained demo model: which memory does the passcode come from?

    python benchmarks/bench_interventions.py                       # builtin:demo, 8K tokens
    python benchmarks/bench_interventions.py --tokens 32768 --controls 8 --kda heads --json rows.json

Builds the demo's context (`workbench demo`: documents with the passcode planted in the second, the
trained model's own wording), asks the question, and runs `workbench.attribution` on the needle's
positions: the needle hidden from each DSA layer and from all of them, each KDA head's (or layer's)
writes over the needle suppressed, each MoE layer's answer experts banned, each beside `--controls`
random interventions of the same size (a random span of the needle's length, as many random experts).
The target is the passcode's tokens after the prefilled `key: `; effects are changes of its total
log-probability (nats). Also times the sweep's continuations against prefilling the context once per
row (what a sweep without forks would cost), and the plain decode step with no intervention set.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd  # noqa: E402
import torch  # noqa: E402

import workbench  # noqa: E402
from engine.session import Session  # noqa: E402
from prompts import demo_prompt  # noqa: E402
from workbench.sessions import load_with_tokenizer  # noqa: E402
from workbench.retrieval_text import answer_style_of  # noqa: E402


CHECKED_PER_LAYER = "set, not reached, checked by every layer (before)"


def decode_switch_cost(session: Session, ask, steps: int, repeats: int) -> dict[str, float]:
    """Milliseconds per decode token from forks of one prefilled context, interleaved: no intervention set
    against one set that the decode never reaches (every layer still checks it)."""
    far = len(session.tokens) + 4 * steps + 64
    times: dict[str, list[float]] = {"none": [], "set, not reached": [], CHECKED_PER_LAYER: []}
    for _ in range(repeats):
        for label, spent in times.items():
            branch = session.fork()
            ask(branch)
            branch.prefill()
            if label != "none":
                branch.set_interventions([{"op": "kda.suppress_writes", "positions": [far, far + 1], "layers": "all"}])
            if label == CHECKED_PER_LAYER:
                # what every step did before plans knew their reach: the plan handed to the layers, each
                # KDA layer evaluating its rule (the same computation: the rule never matches)
                branch._interventions.acts_on = lambda start, stop: True
            stamps = [time.perf_counter() for _ in branch.generate(max_new_tokens=steps, temperature=0.0)]
            if len(stamps) > 1:  # the first token includes the question's prefill
                spent.append(1e3 * (stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return {label: min(spent) for label, spent in times.items()}


def key_mask_cost(keys: int, counts: list[int], repeats: int) -> list[tuple[int, float, float]]:
    """(ranges, ms of the `[Tk, R]` range table, ms of `in_any_range`) for one DSA key mask over `keys`
    keys, interleaved best of `repeats`: what a mask of many hidden ranges costs each layer per call."""
    from engine.interventions.plan import in_any_range, in_ranges

    positions = torch.arange(keys)
    out = []
    for count in counts:
        starts = torch.sort(torch.randperm(keys // 64)[:count] * 64).values
        ranges = torch.stack([starts, starts + 32], 1)
        assert torch.equal(in_ranges(positions, ranges).any(-1), in_any_range(positions, ranges))
        best = [float("inf"), float("inf")]
        for _ in range(repeats):
            for i, fn in enumerate((lambda: in_ranges(positions, ranges).any(-1), lambda: in_any_range(positions, ranges))):
                t0 = time.perf_counter()
                fn()
                best[i] = min(best[i], time.perf_counter() - t0)
        out.append((count, 1e3 * best[0], 1e3 * best[1]))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:demo")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--controls", type=int, default=8, help="disjoint same-size controls per row (8: a verdict)")
    p.add_argument("--kda", choices=("heads", "layers", "none"), default="heads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--only", choices=("decode", "sweep", "masks"), help="run only the decode-step timing, only the "
                   "sweep, or only the key-mask cost of many hidden ranges (no model)")
    p.add_argument("--decode-steps", type=int, default=32, help="decode tokens per branch when timing the switch")
    p.add_argument("--decode-repeats", type=int, default=5, help="interleaved repeats when timing the switch")
    args = p.parse_args()
    if args.only == "masks":
        torch.set_num_threads(1)
        for count, table, search in key_mask_cost(args.tokens, [4, 16, 128, 512], 7):
            print(f"{count:4d} ranges over {args.tokens} keys: range table {table:.2f} ms, in_any_range {search:.2f} ms "
                  f"(ratio {search / table:.3f}; best of 7 interleaved, one thread)")
        return 0

    model, tokenizer = load_with_tokenizer(args.model)
    style = answer_style_of(args.model)
    prompt = demo_prompt(model, tokenizer, args.tokens, style)
    session, needle, ask = prompt.session, prompt.needle, prompt.ask
    target = tokenizer.encode(prompt.target)
    base = session.fork()  # not prefilled: attribution forks its KDA rows before the needle
    t0 = time.perf_counter()
    session.prefill()
    context_s = time.perf_counter() - t0
    hidden = workbench.effects(session, {"op": "dsa.hide", "positions": list(needle), "layers": "all"},
                               continuation=ask, target=target, max_new_tokens=12)
    print(f"context {len(session.tokens)} tokens (prefill {context_s:.1f} s); needle at {list(needle)}")
    print(hidden.summary())

    if args.only == "sweep":
        switch = {}
    else:
        switch = decode_switch_cost(session, ask, args.decode_steps, args.decode_repeats)
    if switch:
        print("\ndecode step, best of {} interleaved runs of {} tokens: ".format(args.decode_repeats, args.decode_steps)
              + "; ".join(f"{label} {ms:.2f} ms/token" for label, ms in switch.items())
              + f"; ratio {switch['set, not reached'] / switch['none']:.3f} (before the plan's reach was checked: "
              f"{switch[CHECKED_PER_LAYER] / switch['none']:.3f})")
    if args.only == "decode":
        return 0

    t0 = time.perf_counter()
    frame = workbench.attribution(base, [("needle", *needle)], continuation=ask, target=target,
                                  kda=None if args.kda == "none" else args.kda, controls=args.controls,
                                  seed=args.seed)
    sweep_s = time.perf_counter() - t0
    rows = len(frame) * (1 + args.controls)
    print(f"\nattribution: {len(frame)} rows x (1 + {args.controls} controls) = {rows} runs in {sweep_s:.1f} s; "
          f"a prefill of the context per run instead: ~{rows * context_s:.0f} s (runs x the prefill measured above)")
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(frame.drop(columns=["plain", "verdict"]).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print("\n".join(f"{r.op} {r.segment or ''} layer {r.layer}: {r.verdict}" for r in frame.head(5).itertuples()))
    print(f"target log-probability without intervention: {frame['plain'].iloc[0]:.4f} nats "
          f"({len(target)} tokens)")
    if args.json:
        args.json.write_text(json.dumps({"tokens": len(session.tokens), "needle": list(needle),
                                         "context_prefill_s": context_s, "sweep_s": sweep_s,
                                         "decode_ms_per_token": switch,
                                         "rows": json.loads(frame.to_json(orient="records"))}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
