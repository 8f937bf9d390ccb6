"""Needle accuracy with 95% intervals, in-world and held-out, at several lengths: the demo model's report card.

A cell is (world, length, prompts). `in-world` prompts are drawn fresh from the trained wording
(`workbench.retrieval_text.TRAIN`: its needle and question templates and filler, with keys, values
and filler the training run never drew for this seed); `held-out` prompts use `HELD_OUT`, whose
filler, key names and needle and question wording the training generator never produces. The two
are reported apart because they answer different questions: in-world is what the model was trained
to do (and what the task templates ask it), held-out is how far that transfers.

Each prompt runs the real path: a `Session` on the loaded checkpoint with chunked prefill (bounded
memory at any length, on the model's device), then the expected response teacher-forced. Its value
is right when every value token is the argmax after its prefix, which is exactly when greedy decoding
after a response prefilled with the key would produce it. Depths cycle through `depths`, so each
depth gets a third of the prompts.

A cell of n prompts with k right gets the Wilson score interval: unlike the normal approximation it
stays inside [0, 1] and is honest at k = 0 or k = n and at the small n a CPU allows. While the value
tokens run, a sink on each DSA layer counts the queries whose top-k selection hits the value's
tokens in the needle, beside the exact chance of that for uniformly random picks.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.session import Session
from engine.tokenizer import Tokenizer
from training.tasks import answer_ids, needle_prompt
from workbench.analysis.chance import chance_of_hit, format_read
from workbench.retrieval_text import HELD_OUT, TRAIN, World

WORLDS: dict[str, World] = {"in-world": TRAIN, "held-out": HELD_OUT}
DEPTHS = (0.1, 0.5, 0.9)
Z95 = 1.959964


@dataclass(frozen=True)
class Cell:
    world: str      # a key of WORLDS
    length: int     # prompt tokens (about)
    prompts: int


def parse_cells(spec: str) -> list[Cell]:
    """`in-world:2048x24,held-out:8192x24` -> cells (the command-line form)."""
    cells = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        try:
            world, rest = part.split(":")
            length, prompts = (int(x) for x in rest.lower().split("x"))
        except ValueError:
            raise ValueError(f"a cell is WORLD:LENGTHxPROMPTS (e.g. in-world:2048x24), got {part!r}") from None
        if world not in WORLDS:
            raise ValueError(f"cell {part!r}: the world must be one of {sorted(WORLDS)}")
        if length < 256 or prompts < 1:
            raise ValueError(f"cell {part!r}: length must be >= 256 and prompts >= 1")
        cells.append(Cell(world, length, prompts))
    if not cells:
        raise ValueError("no cells given")
    return cells


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion k / n (95% for the default z)."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # exact ends where the count is: rounding would otherwise put 24/24 at 0.9999999999999999
    return (0.0 if k == 0 else max(0.0, centre - half)), (1.0 if k == n else min(1.0, centre + half))


@dataclass
class _Case:
    ids: list[int]          # prompt + the expected response, teacher-forced
    prompt_len: int
    value_at: int           # offset in the response ids where the model's own part (after the prefill) starts
    value_span: tuple[int, int]   # token span of the needle's value in the prompt
    value_queries: tuple[int, int]  # offsets in the response ids of the value's own tokens


def _cases(tok: Tokenizer, cell: Cell, seed: int, depths: Sequence[float], style: str) -> list[_Case]:
    # one generator per cell, seeded by its name: a cell's prompts do not depend on which other cells run
    rng = random.Random(f"{seed}:{cell.world}:{cell.length}")
    cases = []
    for i in range(cell.prompts):
        s = needle_prompt(tok, WORLDS[cell.world], rng, cell.length, depths[i % len(depths)], style)
        before, ans, after = answer_ids(tok, s.response)
        target = before + ans + after[:1]
        fact = s.facts[0]
        n_value = len(tok.encode(s.answer))
        at = fact.start + len(tok.encode(fact.text[: fact.text.rindex(s.answer)]))
        end_of_answer = len(before) + len(ans)
        cases.append(_Case(s.ids[: s.prompt_len] + target, s.prompt_len, len(before) + len(tok.encode(s.prefill)),
                           (at, at + n_value), (end_of_answer - n_value, end_of_answer)))
    return cases


@torch.no_grad()
def forced_predictions(model, tok: Tokenizer, prompt: list[int], target: list[int], chunk: int,
                       sink: Callable | None = None) -> list[int]:
    """The argmax token at each position of `target` after `prompt`, with `target` teacher-forced on a
    `Session` (chunked prefill); `sink`, when given, receives every DSA layer's top-k emission while the
    target runs. Greedy decoding produces `target` exactly when the result equals it."""
    session = Session(model, tok, prefill_chunk=chunk, progress=False)
    session.append(ids=prompt, name="prompt")
    first = session.prefill()
    points = [m.probe_topk for m in model.modules() if getattr(m, "indexer", None) is not None] if sink else []
    for p in points:
        p.sink = sink
    try:
        # query position t predicts token t + 1: the prompt's last position predicts target[0]
        logits = session.feed(target[:-1], name="answer")
    finally:
        for p in points:
            p.sink = None
    return [int(first.argmax())] + logits.argmax(-1).tolist()


@torch.no_grad()
def _run_case(model, tok: Tokenizer, case: _Case, chunk: int, reads: dict) -> tuple[bool, bool]:
    """(value right, whole response right) for one prompt; adds its value reads to `reads`
    ({layer: [hits, queries, chance sum]})."""
    target = case.ids[case.prompt_len:]
    q_lo = case.prompt_len - 1 + case.value_queries[0]   # query position t predicts token t + 1
    q_hi = case.prompt_len - 1 + case.value_queries[1]
    a, b = case.value_span
    topk = model.config.dsa.topk if model.config.dsa else 0

    def sink(emission) -> None:
        positions = emission.data["positions"]
        keep = (positions >= q_lo) & (positions < q_hi)
        if not bool(keep.any()):
            return
        idx = emission.data["indices"][0][keep.to(emission.data["indices"].device)]
        hit = ((idx >= a) & (idx < b)).any(-1)
        entry = reads.setdefault(emission.point.layer, [0, 0, 0.0])
        entry[0] += int(hit.sum())
        entry[1] += int(hit.numel())
        entry[2] += float(np.sum(chance_of_hit(positions[keep].cpu().numpy() + 1, b - a, topk)))

    pred = forced_predictions(model, tok, case.ids[: case.prompt_len], target, chunk, sink)
    return pred[case.value_at:] == target[case.value_at:], pred == target


def run_cells(model, tok: Tokenizer, cells: Sequence[Cell], *, seed: int = 99, depths: Sequence[float] = DEPTHS,
              prefill_chunk: int = 4096, style: str = "key", log: Callable[[str], None] | None = print) -> list[dict]:
    """One row per cell: {world, length, prompts, value_correct, correct, lo, hi, seconds, reads}.

    `value_correct`: prompts whose value was right given the key (what a template's prefilled answer
    produces); `correct`: the whole response, key included, generated. `lo`/`hi`: the 95% Wilson
    interval of value_correct / prompts. `reads`: per DSA layer, the share of value-token queries that
    selected a value token, and its chance."""
    was_training = model.training
    model.eval()
    rows = []
    try:
        for cell in cells:
            started = time.perf_counter()
            reads: dict = {}
            value = whole = 0
            for case in _cases(tok, cell, seed, depths, style):
                v, w = _run_case(model, tok, case, prefill_chunk, reads)
                value, whole = value + v, whole + w
            lo, hi = wilson(value, cell.prompts)
            row = {"world": cell.world, "length": cell.length, "prompts": cell.prompts, "value_correct": value,
                   "correct": whole, "lo": round(lo, 4), "hi": round(hi, 4),
                   "seconds": round(time.perf_counter() - started, 1),
                   "reads": {str(layer): {"read": h / max(n, 1), "chance": c / max(n, 1)}
                             for layer, (h, n, c) in sorted(reads.items())}}
            rows.append(row)
            if log is not None:
                log(f"{cell.world:>8} {cell.length:>7,} tokens: value {value}/{cell.prompts} "
                    f"({value / cell.prompts:.0%}, 95% {lo:.0%}-{hi:.0%}), whole response {whole}/{cell.prompts}"
                    f" ({row['seconds']:.0f} s)")
    finally:
        model.train(was_training)
    return rows


def pooled(rows: Sequence[dict], world: str) -> tuple[int, int, float, float]:
    """(right, prompts, lo, hi) of one world over every length in `rows`."""
    k = sum(r["value_correct"] for r in rows if r["world"] == world)
    n = sum(r["prompts"] for r in rows if r["world"] == world)
    return (k, n, *wilson(k, n))


def _best_read(reads: dict) -> str:
    if not reads:
        return "-"
    layer, r = max(reads.items(), key=lambda kv: kv[1]["read"] / max(kv[1]["chance"], 1e-12))
    return f"layer {layer}: {format_read(r['read'], r['chance'])}"


def markdown(rows: Sequence[dict], title: str) -> str:
    """The rows as a Markdown table (one line per cell, in-world first), then each world pooled."""
    lines = [f"# {title}", "",
             "Value right given the key (what a prompt with the answer prefilled as `key: ` produces) out of the",
             "prompts, with its 95% Wilson interval; the whole response (key generated too) beside it. Reads: the",
             "DSA layer whose selections hit the needle's value tokens most above chance, for the value tokens'",
             "queries, beside the chance of that for uniformly random picks.", "",
             "| world | tokens | value right | rate | 95% interval | whole response | value's tokens read |",
             "|---|---:|---:|---:|---|---:|---|"]
    ordered = sorted(rows, key=lambda r: (list(WORLDS).index(r["world"]), r["length"]))
    for r in ordered:
        lines.append(f"| {r['world']} | {r['length']:,} | {r['value_correct']}/{r['prompts']} | "
                     f"{r['value_correct'] / r['prompts']:.0%} | {r['lo']:.0%}-{r['hi']:.0%} | "
                     f"{r['correct']}/{r['prompts']} | {_best_read(r.get('reads', {}))} |")
    lines += ["", "| world | all lengths | rate | 95% interval |", "|---|---:|---:|---|"]
    for world in WORLDS:
        k, n, lo, hi = pooled(rows, world)
        if n:
            lines.append(f"| {world} | {k}/{n} | {k / n:.0%} | {lo:.0%}-{hi:.0%} |")
    return "\n".join(lines) + "\n"


def compare(new: Sequence[dict], base: Sequence[dict]) -> dict:
    """Per world, pooled over the lengths both tables measured: each side's rate and interval, and the verdict.

    `better` for a world: the new rate is higher and its interval's lower end is above the base's
    point estimate (clear evidence of a gain); `not worse`: the two intervals overlap (no clear
    evidence of a loss). A new model beats the base when it is better held-out and not worse in-world."""
    out: dict = {}
    for world in WORLDS:
        lengths = ({r["length"] for r in new if r["world"] == world}
                   & {r["length"] for r in base if r["world"] == world})
        if not lengths:
            continue
        a = pooled([r for r in new if r["length"] in lengths], world)
        b = pooled([r for r in base if r["length"] in lengths], world)
        rate_a, rate_b = a[0] / a[1], b[0] / b[1]
        out[world] = {"lengths": sorted(lengths), "new": list(a), "base": list(b),
                      "better": rate_a > rate_b and a[2] > rate_b, "not_worse": a[3] >= b[2]}
    out["beats"] = bool(out.get("held-out", {}).get("better") and out.get("in-world", {}).get("not_worse"))
    return out


def write_tables(rows: Sequence[dict], out_dir: Path, title: str, stem: str = "intervals") -> None:
    """`<stem>.json` (the rows) and `<stem>.md` (the table) in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(list(rows), indent=1) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown(rows, title))


__all__ = ["Cell", "DEPTHS", "WORLDS", "compare", "forced_predictions", "markdown", "parse_cells", "pooled", "run_cells", "wilson",
           "write_tables"]
