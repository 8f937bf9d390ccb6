"""Which memory an answer depends on: `attribution(...)`, a sweep of interventions, each
beside a control of the same size.

For a target answer (e.g. the needle's value) after a continuation (the question), every candidate
memory is switched off in turn and the change of the target's log-probability is measured:

- `dsa.hide`: each segment hidden from each DSA layer (and from all of them at once); controls:
  random spans of the same length hidden from the same layers;
- `kda.suppress_writes`: each KDA layer's (or head's) writes over each segment suppressed; controls: the
  same heads' writes over random spans of the same length after the segment's start (with too little
  room there, anywhere); every run continues from the state kept at its own span's start, so a control
  re-runs only the context after it (the rows of one segment share their controls and those states);
- `moe.ban`: on each MoE layer, the experts the target's tokens were routed to, banned for the
  continuation; control: as many other experts, drawn at random.

Each effect is shown beside its controls (their mean and range over `controls` draws, default 8),
and judged by `workbench.analysis.causal.verdict` (its rank among them, an empirical p-value, and a
sentence). Control spans never overlap the row's span, the answer's `evidence` or each other; where
too few fit, the row says so and gives no verdict (house rule: a statistic chance could produce is
shown beside its chance value). Cost: the context is prefilled once; DSA and MoE rows are
continuations only (question + target tokens). KDA rows change writes inside the context, so each
re-runs the context from its first suppressed position (a partial prefill per run, from a state kept
there while the context was prefilled once): off by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from engine.errors import InputError
from engine.probes import probe_points
from workbench.analysis.causal import ACTION_WORDS, DEFAULT_CONTROLS, control_spans, verdict
from workbench.causal_effects import (Continuation, _continue, _forced_logprobs, _ids, target_logprobs,
                                      task_scoring)
from workbench.interventions import _segment_span, check_attribution_args
from workbench.task_templates import recorded_spans


@dataclass
class _Run:
    """One intervention to score: its spec, the position its branch forks at, and what it is a row of."""

    spec: list[dict]
    fork_at: int
    row: dict
    control: bool


def _score(base: Any, spec: list[dict], continuation: Any, target: list[int], role: str) -> np.ndarray:
    """Per-token log-probabilities of `target` after the continuation, on a fork of `base` with `spec`."""
    return target_logprobs(base, spec, continuation, target, role)


def _answer_experts(base: Any, continuation: Any, target: list[int], role: str, top: int) -> dict[int, list[int]]:
    """Per MoE layer, the `top` experts routed most often for the tokens that predict the target (a
    listener beside any other on the route probes)."""
    counts: dict[int, np.ndarray] = {}
    first: list[int] = []

    def sink(emission) -> None:
        experts = emission.data["experts"][0].cpu().numpy()  # [n, k]
        positions = emission.data["positions"].cpu().numpy()
        keep = positions >= first[0]
        layer = counts.setdefault(emission.point.layer, np.zeros(base.config.num_experts, np.int64))
        np.add.at(layer, experts[keep].reshape(-1), 1)

    branch = base.fork()
    _continue(branch, continuation, role)
    first.append(len(branch.tokens) - 1)  # the last continuation token predicts the target's first
    points = [p for p in probe_points(base.model) if p.name == "moe.route"]
    for p in points:
        p.attach(sink)
    try:
        branch.prefill()
        _forced_logprobs(branch, target)
        for p in points:
            p.deliver()
    finally:
        for p in points:
            p.detach(sink)
    return {layer: [int(e) for e in np.argsort(-c, kind="stable")[:top] if c[e] > 0] for layer, c in counts.items()}


def attribution(session: Any, segments: Sequence[str | tuple[str, int, int]], *, continuation: Continuation | str | Sequence[int] | None,
                target: str | Sequence[int] | None = None, dsa: bool = True, kda: str | None = None,
                moe: bool = True, controls: int = DEFAULT_CONTROLS, seed: int = 0, role: str = "user",
                experts: int | None = None, evidence: Sequence[tuple[int, int]] = ()) -> Any:
    """Rank the memories the target answer depends on; see the module doc.

    Args:
        session: holds the context (appended; prefilled or not, but not past a segment when `kda` is set).
        segments: names of the segments to switch off (documents, an image, a turn) or of spans a task
            template recorded ("the fact", "restatement 1"), or (label, start, end) spans of positions
            (a needle inside its document).
        continuation, target, role: as `workbench.effects`.
        dsa, moe: sweep DSA layers / MoE experts. kda: None, "layers" (each KDA layer's heads together)
            or "heads" (each head alone): these rows re-run the context from the segment.
        controls: random same-size controls per row (seeded by `seed`: deterministic), disjoint from the
            row's span, from `evidence` and from each other (`workbench.analysis.causal.control_spans`).
        experts: experts banned per MoE layer (default: the model's experts per token).
        evidence: spans of the answer's own evidence (the fact and its restatements, e.g.
            `TaskAnswer.spans`) no control may touch.

    Returns:
        a pandas DataFrame, one row per intervention, largest drop first: `op`, `segment`, `layer`
        ("all" or an id), `heads`, `experts`, `size` (positions or experts switched off), `effect` (change of
        the target's total log-probability, nats), `control_mean`, `control_min`, `control_max`,
        `controls` (how many fitted), `plain` (the target's log-probability without intervention),
        `rank` and `p_value` (the effect among its controls) and `verdict` (the sentence; "no verdict"
        with the reason when too few controls fitted).
    """
    import pandas as pd

    config = session.config
    continuation, target = task_scoring(continuation, target)
    check_attribution_args(session, segments, continuation=continuation, target=target, controls=controls, seed=seed,
                           experts=experts, evidence=evidence, flags={"dsa": dsa, "moe": moe}, role=role)
    target_ids = _ids(session, target)
    assert target_ids is not None
    if kda not in (None, "layers", "heads"):
        raise InputError(f"kda must be None, 'layers' or 'heads', got {kda!r}")
    if isinstance(controls, bool) or not isinstance(controls, int) or controls < 1:
        raise InputError(f"controls must be an integer >= 1, got {controls!r}")
    spans = {}
    for item in segments:
        if isinstance(item, str) and item in recorded_spans(session):   # "the fact" a task template recorded
            spans[item] = recorded_spans(session)[item]
        elif isinstance(item, str):
            spans[item] = _segment_span(session, item, f"segment {item!r}")
        else:  # (label, start, end): a span inside a segment (a needle inside its document)
            label, start, stop = item
            if not 0 <= start < stop <= len(session.tokens):
                raise InputError(f"span {label!r}: [{start}, {stop}) is not inside the context's {len(session.tokens)} tokens")
            spans[str(label)] = (int(start), int(stop))
    end = len(session.tokens)
    rng = np.random.default_rng(seed)
    layers = range(config.num_hidden_layers)
    runs: list[_Run] = []

    notes: dict[tuple, str] = {}
    evidence = [(int(a), int(b)) for a, b in evidence]

    def draw(span: tuple[int, int], lowest: int = 0) -> tuple[tuple[tuple[int, int], ...], str]:
        """The row's control spans: after `lowest` when they fit there (a KDA row re-runs less), else anywhere."""
        found = control_spans(span[1] - span[0], (lowest, end), [span, *evidence], controls, seed)
        if not found.enough and lowest > 0:
            found = control_spans(span[1] - span[0], (0, end), [span, *evidence], controls, seed)
        return found.spans, found.note

    def add(op: str, spec_for, size: int, row: dict, fork_for, avoid: tuple[int, int], lowest: int = 0) -> None:
        runs.append(_Run(spec_for(spans[row["segment"]]) if row["segment"] else spec_for(None), fork_for(avoid),
                         {"op": op, "size": size, **row}, False))
        if row["segment"]:
            chosen, note = draw(avoid, lowest)
            notes[(op, row["segment"], str(row["layer"]), str(row["heads"]))] = note
            for span in chosen:
                runs.append(_Run(spec_for(span), fork_for(span), {"op": op, "size": size, **row}, True))
        else:
            for _ in range(controls):
                runs.append(_Run(spec_for(None, control=True), end, {"op": op, "size": size, **row}, True))

    if dsa:
        dsa_layers = [i for i in layers if config.is_dsa_layer(i)]
        for name, span in spans.items():
            for layer in [*dsa_layers, "all"]:
                ids = "all" if layer == "all" else [layer]
                add("dsa.hide", lambda s, ids=ids: [{"op": "dsa.hide", "positions": list(s), "layers": ids}],
                    span[1] - span[0], {"segment": name, "layer": layer, "heads": None, "experts": None},
                    lambda s: end, span)
    if kda is not None:
        kda_layers = [i for i in layers if config.is_kda_layer(i)]
        groups = ([(i, "all") for i in kda_layers] if kda == "layers"
                  else [(i, [h]) for i in kda_layers for h in range(config.kda_num_heads)])
        for name, span in spans.items():
            for layer, heads in groups:
                add("kda.suppress_writes",
                    lambda s, layer=layer, heads=heads: [{"op": "kda.suppress_writes", "positions": list(s),
                                                          "layers": [layer], "heads": heads}],
                    span[1] - span[0], {"segment": name, "layer": layer, "heads": heads, "experts": None},
                    lambda s: s[0], span, lowest=span[0])
    # forks at ascending positions: the context is prefilled once, each branch point kept as a fork
    first = min([r.fork_at for r in runs], default=end)
    if session.length > first:
        raise InputError(f"the session has consumed {session.length} tokens, past the first position a row must "
                         f"fork at ({first}): start from a session prefilled less far")
    bases: dict[int, Any] = {}
    for at in sorted({r.fork_at for r in runs} | {end}):
        session.prefill(until=at)
        bases[at] = session.fork()
    if moe:
        top = experts or config.num_experts_per_token
        chosen = _answer_experts(bases[end], continuation, target_ids, role, top)
        for layer in sorted(chosen):
            banned = chosen[layer]
            others = [e for e in range(config.num_experts) if e not in banned]

            def spec_for(_, control: bool = False, layer=layer, banned=banned, others=others):
                picked = sorted(rng.choice(others, size=min(len(banned), len(others)), replace=False).tolist()
                                ) if control else banned
                return [{"op": "moe.ban", "experts": picked, "layers": [layer], "positions": [end, 1 << 40]}]

            add("moe.ban", spec_for, len(banned), {"segment": None, "layer": layer, "heads": None,
                                                   "experts": banned}, lambda s: end, (end, end))
    plain = _score(bases[end], [], continuation, target_ids, role).sum()
    results: dict[tuple, dict] = {}
    for run in runs:
        logprob = float(_score(bases[run.fork_at], run.spec, continuation, target_ids, role).sum())
        key = (run.row["op"], run.row["segment"], str(run.row["layer"]), str(run.row["heads"]))
        entry = results.setdefault(key, {**run.row, "effect": np.nan, "controls": []})
        if run.control:
            entry["controls"].append(logprob - plain)
        else:
            entry["effect"] = logprob - plain
    rows = []
    for key, entry in results.items():
        c = np.array(entry.pop("controls"), dtype=float)
        what = entry["segment"] if entry["segment"] else f"experts {entry['experts']} of layer {entry['layer']}"
        where = "" if entry["layer"] == "all" or not entry["segment"] else f"from layer {entry['layer']}"
        found = verdict(entry["effect"], c, what, where=where, note=notes.get(key, ""),
                        unit="span" if entry["segment"] else "set of experts", action=ACTION_WORDS[entry["op"]])
        rows.append({**entry, "layer": str(entry["layer"]), "control_mean": float(c.mean()) if len(c) else np.nan,
                     "control_min": float(c.min()) if len(c) else np.nan,
                     "control_max": float(c.max()) if len(c) else np.nan, "controls": len(c), "plain": float(plain),
                     "rank": found.rank, "p_value": found.p_value, "verdict": found.sentence})
    frame = pd.DataFrame(rows, columns=["op", "segment", "layer", "heads", "experts", "size", "effect",
                                        "control_mean", "control_min", "control_max", "controls", "plain", "rank",
                                        "p_value", "verdict"])
    return frame.sort_values("effect", kind="stable").reset_index(drop=True)
