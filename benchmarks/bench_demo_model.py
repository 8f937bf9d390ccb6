"""Needle accuracy of the trained demo model with 95% intervals: in-world and held-out wording, by length.

    python benchmarks/bench_demo_model.py                                        # the shipped table's cells
    python benchmarks/bench_demo_model.py --cells in-world:2048x24,held-out:2048x24 --json rows.json
    python benchmarks/bench_demo_model.py --render rows.json --markdown INTERVALS.md   # table from kept rows
    python benchmarks/bench_demo_model.py --compare engine/builtin/demo/intervals.json --json new.json
    python benchmarks/bench_demo_model.py --by-depth --lengths 2048,8192 --samples 8,4   # depths, sparse vs dense

The default runs `training.interval_table`: cells of (world, length, prompts), each prompt a real
`Session` on the checkpoint as written (MXFP4 experts, chunked prefill) with the expected response
teacher-forced; a value is right when greedy decoding after the prefilled key would produce it.
In-world prompts use the trained wording with fresh keys, values and filler; held-out prompts use
`workbench.retrieval_text.HELD_OUT` (filler, key names and needle and question wording the training
generator never produces). Each cell gets a 95% Wilson interval, and the DSA reads of the value's
tokens beside chance. `--compare` prints, per world, this model's pooled rate beside a kept table's.

`--by-depth` is the older view: held-out prompts by length x depth, DSA sparse (as trained) beside
`model.runtime.dsa_force_dense`, with the needle reads beside chance.
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
from engine.tokenizer import Tokenizer  # noqa: E402
from training import interval_table  # noqa: E402
from training.tasks import HELD_OUT, answer_ids, needle_prompt  # noqa: E402
from workbench.retrieval_text import answer_style_of  # noqa: E402
from workbench.analysis.chance import chance_of_hit, format_read  # noqa: E402


def run_case(model, tok: Tokenizer, ids: list[int], plen: int, target: list[int], needle: tuple[int, int],
             chunk: int, value: tuple[int, int] | None = None) -> dict:
    """See `run_case_spans`; reads of the `needle` span only (as {layer: {read, chance}})."""
    out = run_case_spans(model, tok, ids, plen, target, {"needle": needle}, chunk, value)
    return {"correct": out["correct"], "value_correct": out["value_correct"],
            "layers": {la: v["needle"] for la, v in out["layers"].items()}}


def run_case_spans(model, tok: Tokenizer, ids: list[int], plen: int, target: list[int],
                   spans: dict[str, tuple[int, int]], chunk: int, value: tuple[int, int] | None = None,
                   reads: tuple[int, int] | None = None) -> dict:
    """One prompt: exact-answer check plus per-DSA-layer needle reads.

    `value`: offsets into `target` of the model's own part of the answer (default all of it);
    `value_correct` says whether it and what follows are right. Reads are counted for the queries that
    predict the tokens of `reads` (default `value`), not for the fixed response scaffold around them.
    """
    check_lo = (value if value is not None else (0, len(target)))[0]
    lo, hi = reads if reads is not None else value if value is not None else (0, len(target))
    q_lo, q_hi = plen - 1 + lo, plen - 1 + hi   # query position t predicts token t + 1
    hits: dict[tuple[int, str], list[bool]] = {}
    chance: dict[tuple[int, str], list[float]] = {}
    topk = model.config.dsa.topk if model.config.dsa else 0

    def sink(emission) -> None:
        point, payload = emission.point, emission.data
        keep = (payload["positions"] >= q_lo) & (payload["positions"] < q_hi)
        if not bool(keep.any()):
            return
        pos = payload["positions"][keep]
        idx = payload["indices"][0][keep.to(payload["indices"].device)]     # [n, k]
        for name, (a, b) in spans.items():
            hit = ((idx >= a) & (idx < b)).any(-1)
            hits.setdefault((point.layer, name), []).extend(hit.tolist())
            chance.setdefault((point.layer, name), []).extend(
                np.atleast_1d(chance_of_hit(pos.numpy() + 1, b - a, topk)).tolist())

    pred = interval_table.forced_predictions(model, tok, ids[:plen], target, chunk, sink)
    layers: dict[int, dict[str, dict[str, float]]] = {}
    for (layer, name), r in hits.items():
        layers.setdefault(layer, {})[name] = {"read": float(np.mean(r)), "chance": float(np.mean(chance[(layer, name)]))}
    # full: the whole response (restated key and value) is the greedy output; value: the value is,
    # given the key before it (what a response prefilled with `key: ` would produce)
    return {"correct": pred == target, "value_correct": pred[check_lo:] == target[check_lo:], "layers": layers}


def _best_layer(results: list[dict], span: str) -> tuple[int, float, float] | None:
    """(layer, mean read rate, mean chance) of the layer with the highest read/chance ratio."""
    best = None
    for layer in sorted({la for r in results for la in r["layers"]}):
        read = float(np.mean([r["layers"][layer][span]["read"] for r in results]))
        ch = float(np.mean([r["layers"][layer][span]["chance"] for r in results]))
        if best is None or read / max(ch, 1e-12) > best[1] / max(best[2], 1e-12):
            best = (layer, read, ch)
    return best


DEFAULT_CELLS = ("in-world:2048x24,held-out:2048x24,in-world:8192x24,held-out:8192x24,"
                 "in-world:32768x24,held-out:32768x24,in-world:131072x8")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--by-depth" in argv:
        argv.remove("--by-depth")
        return by_depth_main(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:demo")
    p.add_argument("--cells", default=DEFAULT_CELLS, help="WORLD:LENGTHxPROMPTS,... (worlds: in-world, held-out)")
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=99)
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    p.add_argument("--markdown", type=Path, default=None, help="also write the table as Markdown here")
    p.add_argument("--render", type=Path, default=None,
                   help="run nothing: write --markdown from the rows an earlier run wrote with --json")
    p.add_argument("--compare", type=Path, default=None, help="rows of another model (its intervals.json): "
                   "print both worlds' pooled rates side by side")
    p.add_argument("--by-depth", action="store_true", help="the older table: lengths x depths, sparse vs dense")
    args = p.parse_args(argv)
    title = f"`benchmarks/bench_demo_model.py` on `{args.model}` (seed {args.seed})"
    if args.render:
        if args.markdown is None:
            p.error("--render needs --markdown")
        args.markdown.write_text(interval_table.markdown(json.loads(args.render.read_text()), title))
        return 0
    try:
        cells = interval_table.parse_cells(args.cells)
    except ValueError as exc:
        p.error(str(exc))
    torch.set_num_threads(args.threads)
    path = resolve_builtin(args.model) if is_builtin(args.model) else Path(args.model)
    model = load_model(path)
    tok = Tokenizer.for_model(path, model.config.vocab_size)
    style = answer_style_of(path)
    print(f"model {path} (DSA top-k {model.config.dsa.topk}, answers in the {style!r} style); value right given "
          "the key, 95% Wilson intervals", flush=True)
    rows = interval_table.run_cells(model, tok, cells, seed=args.seed, prefill_chunk=args.prefill_chunk,
                                    style=style, log=lambda line: print(line, flush=True))
    print()
    print(interval_table.markdown(rows, title))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(interval_table.markdown(rows, title))
    if args.compare:
        print(comparison_lines(interval_table.compare(rows, json.loads(args.compare.read_text())), args.compare))
    return 0


def comparison_lines(verdict: dict, base: Path) -> str:
    """Per world: this model's pooled rate and interval beside the base's, then the verdict."""
    lines = [f"compared with {base} (pooled over the lengths both measured):"]
    for world in interval_table.WORLDS:
        if world not in verdict:
            lines.append(f"  {world}: no common lengths")
            continue
        v = verdict[world]
        (k, n, lo, hi), (bk, bn, blo, bhi) = v["new"], v["base"]
        lines.append(f"  {world}: this {k}/{n} = {k / n:.0%} ({lo:.0%}-{hi:.0%}), base {bk}/{bn} = {bk / bn:.0%} "
                     f"({blo:.0%}-{bhi:.0%}); better: {'yes' if v['better'] else 'no'}, "
                     f"not worse: {'yes' if v['not_worse'] else 'no'}")
    lines.append(f"beats the base (better held-out, not worse in-world): {'yes' if verdict['beats'] else 'no'}")
    return "\n".join(lines)


def by_depth_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="held-out needle accuracy by length x depth, sparse vs dense")
    p.add_argument("--model", default="builtin:demo")
    p.add_argument("--lengths", default="2048,8192,32768,65536,131072")
    p.add_argument("--samples", default="8,6,4,2,1", help="prompts per depth for each length")
    p.add_argument("--depths", default="0.1,0.5,0.9")
    p.add_argument("--modes", default="sparse,dense")
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=99)
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    p.add_argument("--markdown", type=Path, default=None,
                   help="also write the table, with the needle reads beside chance, as Markdown here")
    p.add_argument("--render", type=Path, default=None,
                   help="run nothing: write --markdown from the rows an earlier run wrote with --json")
    args = p.parse_args(argv)
    if args.render:
        if args.markdown is None:
            p.error("--render needs --markdown")
        args.markdown.write_text(markdown_table(json.loads(args.render.read_text()), str(args.model), args.seed))
        return 0
    torch.set_num_threads(args.threads)
    path = resolve_builtin(args.model) if is_builtin(args.model) else Path(args.model)
    model = load_model(path)
    tok = Tokenizer.for_model(path, model.config.vocab_size)
    lengths = [int(x) for x in args.lengths.split(",")]
    counts = [int(x) for x in args.samples.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    modes = args.modes.split(",")
    rows = []
    style = answer_style_of(path)
    print(f"model {path} (DSA top-k {model.config.dsa.topk}, answers in the {style!r} style); held-out needle "
          "prompts; exact answer", flush=True)
    for li, length in enumerate(lengths):
        n = counts[min(li, len(counts) - 1)]
        for depth in depths:
            rng = random.Random(args.seed * 7919 + length * 31 + int(depth * 100))
            cases = []
            for _ in range(n):
                s = needle_prompt(tok, HELD_OUT, rng, length, depth, style)
                before, ans, after = answer_ids(tok, s.response)   # `key: value`, or the quoted span
                target = before + ans + after[:1]
                f = s.facts[0]
                n_value = len(tok.encode(s.answer))
                at = f.start + f.text.rindex(s.answer)  # byte-level: character offset = token offset
                spans = {"needle": (f.start, f.end), "value": (at, at + n_value)}
                # the answer tokens that must be right: those after the prefilled part (`key: `, or the
                # key of a span answer); reads are counted for the value's own tokens
                cases.append((s.ids[: s.prompt_len] + target, s.prompt_len, target, spans,
                              (len(before) + len(tok.encode(s.prefill)), len(before) + len(ans)),
                              (len(before) + len(ans) - n_value, len(before) + len(ans))))
            for mode in modes:
                model.runtime.dsa_force_dense = mode == "dense"
                started = time.perf_counter()
                results = [run_case_spans(model, tok, ids, plen, target, spans, args.prefill_chunk, value, reads)
                           for ids, plen, target, spans, value, reads in cases]
                good = [r for r in results if r["value_correct"]]
                row = {"length": length, "depth": depth, "mode": mode, "value_correct": len(good),
                       "correct": sum(r["correct"] for r in results), "total": n,
                       "seconds": round(time.perf_counter() - started, 1)}
                reads = ""
                for span in ("needle", "value"):
                    for label, group in (("right answers", good), ("all prompts", results)):
                        best = _best_layer(group, span)
                        if best is None:
                            continue
                        key = f"{span}_{'right' if group is good else 'all'}"
                        row[key] = {"layer": best[0], "read": best[1], "chance": best[2]}
                        reads += f"; {span} ({label}) layer {best[0]}: {format_read(best[1], best[2])}"
                rows.append(row)
                print(f"{length:>7,} tokens depth {depth:.0%} {mode:6s}: value {len(good)}/{n}, whole response "
                      f"{row['correct']}/{n} ({row['seconds']:.0f} s){reads}", flush=True)
    model.runtime.dsa_force_dense = False
    print("\naccuracy, held-out needle: value given the key (whole response: key and value, both generated);"
          " sparse = DSA as trained, dense = dsa_force_dense")
    header = "| tokens | " + " | ".join(f"{m} {d:.0%}" for m in modes for d in depths) + " |"
    print(header)
    print("|---:|" + "---:|" * (len(modes) * len(depths)))
    for length in lengths:
        cells = []
        for m in modes:
            for d in depths:
                r = next(r for r in rows if r["length"] == length and r["mode"] == m and r["depth"] == d)
                cells.append(f"{r['value_correct']}/{r['total']} ({r['correct']})")
        print(f"| {length:,} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown_table(rows, str(args.model), args.seed))
    return 0


def _read_cell(read: dict | None) -> str:
    return "-" if read is None else f"layer {read['layer']}: {format_read(read['read'], read['chance'])}"


def markdown_table(rows: list[dict], model: str, seed: int) -> str:
    """The rows as one Markdown table per (length, mode): accuracy per depth, then the best DSA layer's
    reads (of the needle sentence, and of the value's own tokens) by the answer's value tokens, each
    beside the chance that random picks hit the same span."""
    depths = sorted({r["depth"] for r in rows})
    lines = [f"# `benchmarks/bench_demo_model.py` on `{model}` (held-out needle prompts, seed {seed})", "",
             "Value given the key, exactly right / prompts (whole response, key included, in brackets). Reads: the",
             "share of the value tokens' queries whose DSA selection hit the span, for the layer that stands highest",
             "above chance, beside the exact chance of that for uniformly random picks (`workbench.analysis.chance`).",
             "", "| tokens | DSA | " + " | ".join(f"depth {d:.0%}" for d in depths)
             + " | value | needle sentence read (all prompts) | value's tokens read (right answers) "
             "| value's tokens read (all prompts) |",
             "|---:|---|" + "---:|" * len(depths) + "---:|---|---|---|"]
    keys = sorted({(r["length"], r["mode"]) for r in rows}, key=lambda lm: (lm[0], lm[1] != "sparse"))
    for length, mode in keys:
        group = {r["depth"]: r for r in rows if r["length"] == length and r["mode"] == mode}
        cells = [f"{group[d]['value_correct']}/{group[d]['total']} ({group[d]['correct']})" if d in group else "-"
                 for d in depths]
        right = sum(r["value_correct"] for r in group.values())
        total = sum(r["total"] for r in group.values())
        reads = [_pooled(list(group.values()), span) for span in ("needle_all", "value_right", "value_all")]
        lines.append(f"| {length:,} | {mode} | " + " | ".join(cells) + f" | {right / max(total, 1):.0%} | "
                     + " | ".join(_read_cell(r) for r in reads) + " |")
    return "\n".join(lines) + "\n"


def _pooled(group: list[dict], key: str) -> dict | None:
    """One layer's read and chance over a row group (the layer most rows chose), each row weighted by
    its prompts: those answered right for a `*_right` key, all of them for a `*_all` key."""
    rows = [(r[key], r["value_correct"] if key.endswith("_right") else r["total"]) for r in group if key in r]
    if not rows:
        return None
    chosen = [x["layer"] for x, _ in rows]
    layer = max(set(chosen), key=chosen.count)
    same = [(x, w) for x, w in rows if x["layer"] == layer]
    n = sum(w for _, w in same)
    return {"layer": layer, "read": sum(x["read"] * w for x, w in same) / n,
            "chance": sum(x["chance"] * w for x, w in same) / n}

if __name__ == "__main__":
    raise SystemExit(main())
