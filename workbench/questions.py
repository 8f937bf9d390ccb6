"""The six questions of the workbench spec (section 6), each one call on a trace: a frame and one line,
a seventh where the trace holds measured effects: which memory did the answer depend on? and an
eighth: did the recording's integrity checks find anything, where and since when?

    trace = workbench.open_trace("traces/demo")
    for name, answer in ask_all(trace).items():
        print(answer.line)

`workbench questions TRACE` prints the same. Every read rate is printed beside its chance value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from workbench.analysis.causal import ACTION_WORDS, verdict_of_summary
from workbench.analysis.chance import chance_of_hit, format_read
from workbench.analysis.dsa import dense_mass_summary, layers_reading
from workbench.analysis.dsa_structure import faithfulness, sink_over_time
from workbench.analysis.image_reads import format_patches, patch_reads
from workbench.analysis.kda_health import heads_at_risk, memory_health
from workbench.analysis.moe import modality_divergence, rank_load_balance
from workbench.trace import Trace
from workbench.interventions import check_positions
from workbench.trace.effects_table import read_effects


@dataclass
class Answer:
    """frame: the table behind the answer; line: the answer in words (figures beside chance)."""

    frame: pd.DataFrame
    line: str


def _topk(trace: Trace) -> int:
    return int(trace.settings.get("topk") or 0)


def _answer_span(trace: Trace, after: int = 0, first: bool = False) -> tuple[int, int] | None:
    """Query positions of a generated segment that starts at or after position `after`: the last
    one, or with `first` the first one (a demo trace answers the needle first, the picture last)."""
    gen = [s for s in trace.segments().itertuples() if s.kind == "generated" and int(s.start) >= after]
    if not gen:
        return None
    seg = gen[0] if first else gen[-1]
    return int(seg.start), int(seg.end) - 1


MAX_POSITION = 2 ** 31 - 1  # positions are int32 in traces


def checked_span(span: object, what: str, *, inclusive: bool) -> tuple[int, int]:
    """`span` as (start, end) token positions, 0 <= start < end <= MAX_POSITION (start <= end when
    `inclusive`); else InputError naming `what` (a span may come from a command line or session.json)."""
    return check_positions(span, what, limit=MAX_POSITION, inclusive=inclusive)


def recorded_needle(trace: Trace) -> tuple[int, int] | None:
    """The needle a trace records: a demo's planted needle, else the fact a task template wrote in
    (`workbench.task_templates.append_task`: session.json `task.spans`); None when it records neither."""
    demo = trace.session.get("demo")
    if isinstance(demo, dict) and demo.get("needle"):
        return tuple(demo["needle"])
    task = trace.session.get("task")
    spans = task.get("spans") if isinstance(task, dict) else None
    fact = spans.get("the fact") if isinstance(spans, dict) else None
    return tuple(fact) if isinstance(fact, list) else None


def needle_readers(trace: Trace, needle: tuple[int, int] | None = None,
                   queries: tuple[int, int] | None = None) -> Answer:
    """Q1: when the model answered, which DSA layers read the needle [start, end), and how far back?

    Defaults: the needle of a `workbench demo` trace (session.json `demo.needle`), or the fact a task
    template recorded (session.json `task.spans`, "the fact"), and the first generated segment after
    it as the queries (the demo's answer to the needle question; a later one answers the question
    about the picture). Chance: P(random top-k picks hit the span) per query, averaged.
    """
    needle = needle or recorded_needle(trace)
    if not needle:
        return Answer(pd.DataFrame(), "Q1 needle: this trace records no needle or fact; give its token positions "
                                      "with --needle START:END (workbench questions) or needle=(start, end) (Python)")
    needle = checked_span(needle, "needle", inclusive=False)
    if queries:
        queries = checked_span(queries, "queries", inclusive=True)
    else:
        queries = _answer_span(trace, after=needle[1], first=True)
    topk = trace.table("dsa_topk", columns=["layer", "position", "selected"])
    df = layers_reading(topk, needle[0], needle[1], queries=queries)
    pos = topk["position"].to_numpy()
    if queries is not None:
        pos = pos[(pos >= queries[0]) & (pos <= queries[1])]
    chance = float(np.mean(chance_of_hit(np.unique(pos) + 1, needle[1] - needle[0], _topk(trace)))) if len(pos) else 0.0
    df["chance"] = chance
    # a layer none of whose queries picked a needle key has no distance (the frame holds -1 there)
    parts = [f"layer {r.layer}: {format_read(r.read_share, chance)}, " +
             (f"nearest {r.distance_min} tokens back" if r.queries_reading > 0 else "never read it")
             for r in df.head(3).itertuples()]
    return Answer(df, f"Q1 needle [{needle[0]}, {needle[1]}): " + ("; ".join(parts) or "no DSA rows"))


# a sink alarm needs this much context: below it a step holds few queries, and random top-k picks still
# read the sink often (at 4x top-k, about two times in three with 4 sink tokens), so a dip is noise
SINK_MIN_CONTEXT = 1024
SINK_MIN_CONTEXT_PER_TOPK = 4


def sink_alarm_context(topk: int) -> int:
    """The shortest context (tokens) at which Q2 may raise a sink alarm for an indexer of this top-k."""
    return max(SINK_MIN_CONTEXT, SINK_MIN_CONTEXT_PER_TOPK * topk)


def sink_readers(trace: Trace, threshold: float = 0.5) -> Answer:
    """Q2: did any DSA layer stop reading the first tokens (attention sink) as the context grew?

    An alarm is raised only at a context of at least `sink_alarm_context(top-k)` tokens; a shorter
    session is reported as too short to tell (its rates are still printed beside chance).
    """
    sink_tokens = int(trace.settings.get("sink_tokens", 4))
    sink = trace.df("dsa_sink")
    timeline, alarms = sink_over_time(sink, threshold=threshold)  # top-k, sink: as recorded
    least = sink_alarm_context(_topk(trace))
    kept = alarms[alarms["position"] + 1 >= least]
    # a layer whose first dip came too early is judged again on its long-context steps alone (a noisy dip
    # at 300 tokens must not hide a real stop at 20K)
    again = sorted(set(alarms["layer"]) - set(kept["layer"]))
    long_rows = sink[(sink["position"] + 1 >= least) & sink["layer"].isin(again)] if again else sink.iloc[:0]
    later = sink_over_time(long_rows, threshold=threshold)[1] if len(long_rows) else kept.iloc[:0]
    alarms = pd.concat([kept, later]).sort_values("layer").reset_index(drop=True) if len(later) else \
        kept.reset_index(drop=True)
    last = timeline.sort_values("step").groupby("layer").tail(1)
    rates = ", ".join(f"{r.layer}: {format_read(r.rate, r.chance)}" for r in last.itertuples())
    longest = int(timeline["position"].max()) + 1 if len(timeline) else 0
    if len(alarms):
        head = (f"ALARM layers {', '.join(map(str, alarms['layer']))} stopped at positions "
                f"{', '.join(map(str, alarms['position']))}")
    elif longest < least:
        head = f"too short to tell ({longest:,} tokens; an alarm needs a context of {least:,})"
    else:
        head = "no layer stopped reading the sink"
    return Answer(alarms if len(alarms) else last, f"Q2 sink (positions 0..{sink_tokens - 1}): {head}; final rate per "
                  f"layer {rates}")


def image_reads(trace: Trace) -> Answer:
    """Q3: which image patches did the model read while describing the image? (per image: patches x reads)"""
    images = [s for s in trace.segments().itertuples() if s.kind == "image"]
    if not images:
        return Answer(pd.DataFrame(), "Q3 image patches: no image in this trace")
    tokens = trace.tokens()
    seg = images[-1]
    queries = _answer_span(trace, after=int(seg.end))
    if queries is None:
        return Answer(pd.DataFrame(), f"Q3 image {seg.name}: nothing was generated after it")
    reads = patch_reads(trace.table("dsa_topk", positions=queries), tokens, int(seg.id), queries=queries)
    counts = reads.grid_of(None)
    top = np.dstack(np.unravel_index(np.argsort(counts, axis=None)[::-1][:3], counts.shape))[0]
    return Answer(reads.table(), f"Q3 image {seg.name} ({reads.grid[0]}x{reads.grid[1]} merged patches), answer "
                  f"tokens {queries[0]}..{queries[1]}: {format_patches(reads.summary())}; most-read (row, col) "
                  f"{', '.join(str(tuple(int(v) for v in c)) for c in top)}")


def kda_heads(trace: Trace, top: int = 3) -> Answer:
    """Q4: which KDA heads saturate or forget fastest, and where in the document?"""
    risk = heads_at_risk(memory_health(trace.df("kda_norms"), trace.segments()), top=top)
    names = dict(zip(trace.segments()["id"], trace.segments()["name"]))

    def where(r) -> str:
        return f"L{r.layer}h{r.head} at {r.position} ({names.get(r.segment, '-')})"

    def extra(value: float, label: str) -> str:  # NaN: the policy did not record it
        return f" {label} {value:.3g}" if np.isfinite(value) else ""

    sat = "; ".join(where(r) + extra(r.min_eff_rank, "eff. rank") for r in risk[risk.kind == "saturates"].itertuples())
    fgt = "; ".join(where(r) + extra(r.half_life, "half-life (tokens)") + extra(r.forget_drop, "norm drop")
                    for r in risk[risk.kind == "forgets"].itertuples())
    return Answer(risk, f"Q4 KDA: saturate first {sat}. Forget fastest {fgt}")


def expert_routing(trace: Trace) -> Answer:
    """Q5: are image tokens routed to different experts than text? Is an expert-parallel rank overloaded?"""
    div = modality_divergence(trace.df("moe_counts"))
    load = rank_load_balance(trace.df("moe_rank_load"))
    js = div["js_divergence"].dropna()
    modal = f"JS(text, image) max {js.max():.2f} bits" if len(js) else "no image tokens routed (text only)"
    # one process: the busiest rank is the only one, 1.00x the mean by definition
    several = load[load["ranks"] > 1] if len(load) else load
    worst = several.sort_values("imbalance", ascending=False).head(1)
    if len(worst):
        ranks = (f"busiest rank {float(worst['imbalance'].iloc[0]):.2f}x the mean (layer {int(worst['layer'].iloc[0])}, "
                 f"{int(worst['ranks'].iloc[0])} ranks)")
    else:
        ranks = "one expert-parallel rank (no load balance to compare)" if len(load) else "no rank load"
    return Answer(load, f"Q5 experts: {modal}; {ranks}")


def dense_mass_kept(trace: Trace) -> Answer:
    """Q6: how much of dense attention's mass does top-k keep on this document? (+ dense top-k recall)"""
    mass = trace.df("dsa_dense_mass")
    if len(mass) == 0:
        return Answer(pd.DataFrame(), "Q6 dense mass: no dense-mass queries recorded (policy dense_mass_stride)")
    summary = dense_mass_summary(mass)
    line = ", ".join(f"layer {r.layer}: {r.mean * 100:.0f}% (p5 {r.p5 * 100:.0f}%, {r.queries} queries)"
                     for r in summary.itertuples())
    if "iou" in mass and mass["iou"].notna().any():
        faith = faithfulness(mass)  # the recorded top-k
        summary = summary.merge(faith[["layer", "iou", "recall", "chance_recall"]], on="layer", how="left")
        line += "; dense top-k recall " + ", ".join(f"{r.layer}: {format_read(r.recall, r.chance_recall)}"
                                                  for r in faith.itertuples())
    return Answer(summary, f"Q6 top-{_topk(trace)} keeps of dense mass: {line}")


def memory_dependence(trace: Trace) -> Answer:
    """Q7: which memory did the answer depend on? From the trace's effects table (`effects.parquet`:
    the demo's causal check, or an attribution sweep written with `write_effects`): per checked answer,
    the switch-off that lowered the target's log-probability most, beside its same-size controls."""
    effects = read_effects(trace)
    if effects is None or not len(effects):
        return Answer(pd.DataFrame(), "Q7 memory: no effects measured in this trace (`workbench demo` writes its "
                                      "causal check there; `workbench.trace.effects_table.write_effects` an attribution)")
    ranked = effects.sort_values("effect", kind="stable")
    parts = []
    for name, rows in ranked.groupby("check_name", sort=False):
        r = rows.iloc[0]
        if isinstance(r["segment"], str):
            what, where = r["segment"], ("" if str(r["layer"]) == "all" else f"from layer {r['layer']}")
        else:
            what, where = f"experts {r['experts']} of layer {r['layer']}", ""
        how = r["op"] + (f", heads {r['heads']}" if isinstance(r["heads"], str) else "")
        found = verdict_of_summary(r["effect"], r["control_min"], r["control_max"], r["controls"], what, where=where,
                                   unit="span" if isinstance(r["segment"], str) else "set of experts",
                                   action=ACTION_WORDS.get(str(r["op"]), "switching off"))
        odds = f" ({found.odds})" if found.odds else ""
        parts.append(f"{name} ({r['target']!r}, log p {r['plain']:.2f}, {how}): {found.sentence}{odds}")
    return Answer(ranked.reset_index(drop=True), "Q7 memory the answer depended on: " + "; ".join(parts))


def integrity_health(trace: Trace) -> Answer:
    """Q8: did the recording's integrity checks find anything, where and since when? The frame
    has one row per (check, layer) (`workbench.signals.integrity.health`), findings first."""
    from workbench.signals import integrity

    table = integrity.health(trace)
    found = integrity.findings(trace)
    rest = table[~table.set_index(["check", "layer"]).index.isin(found.set_index(["check", "layer"]).index)]
    frame = pd.concat([found, rest], ignore_index=True) if len(found) else table
    return Answer(frame, "Q8 " + integrity.summary_line(trace))


QUESTIONS = {"needle": needle_readers, "sink": sink_readers, "image": image_reads, "kda": kda_heads,
             "experts": expert_routing, "dense_mass": dense_mass_kept, "memory": memory_dependence,
             "integrity": integrity_health}


def ask_all(trace: Trace) -> dict[str, Answer]:
    """All the answers (defaults for each); a question the trace cannot answer says why in its line."""
    out = {}
    for name, fn in QUESTIONS.items():
        try:
            out[name] = fn(trace)
        except (KeyError, ValueError) as exc:  # a table the policy did not record
            out[name] = Answer(pd.DataFrame(), f"{name}: not answerable from this trace ({exc})")
    return out
