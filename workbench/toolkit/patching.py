"""Activation patching between a clean and a corrupted run: `patch(...)`.

Two prompts of the same length (e.g. the needle's value replaced) and the clean answer. Both runs fork
from the shared prefix (the session's context and the tokens before the first difference, prefilled
once); the corrupted run is forked again wherever a restoration starts, so each restoration only runs
from there on. One thing at a time is restored from the clean run into the corrupted one:

- `kda`: one KDA head's recurrent state after `state_position` (default: the last differing
  position), written into the corrupted state there (no hook: the state is the session's own);
- `resid`: a layer's output (`blocks.{L}.hook_resid_post`, the block's prefix sum) over a span;
- `dsa`: a DSA layer's selection over a span (`blocks.{L}.dsa.hook_selection`: the clean top-k forced);
- `experts`: a MoE layer's routes over a span (`blocks.{L}.moe.hook_experts`).

Each restoration is scored by the clean answer's log-probability (teacher forced, summed over its
tokens): restored fraction = (patched - corrupted) / (clean - corrupted). Beside it, same-size random
restorations: spans of the same length drawn by `workbench.analysis.causal.control_spans` (never
overlapping the span, the differing span, or each other), and for a KDA head the other heads (and, for
the best `group` heads together, random sets of as many other heads). The verdict is
`workbench.analysis.causal.verdict`'s rule on the gains, said as a restoration.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from engine.cache import KDAState
from engine.errors import InputError
from engine.hooks import hooks
from engine.session import Session
from workbench.analysis.causal import DEFAULT_CONTROLS, DEPENDS, NO_VERDICT, control_spans, verdict
from workbench.toolkit.cache import RowCollector

KINDS = ("kda", "resid", "dsa", "experts")
POINT = {"resid": "hook_resid_post", "dsa": "dsa.hook_selection", "experts": "moe.hook_experts"}


@dataclass(frozen=True)
class PatchCell:
    """One restoration beside its controls.

    Attributes:
        kind: "kda", "resid", "dsa" or "experts".
        layer: the layer restored.
        where: the KDA head (`head 1`) or the span (`1200:1260`) restored.
        gain: patched minus corrupted log-probability of the clean answer, nats.
        fraction: gain / (clean - corrupted).
        controls: the controls' fractions.
        verdict: label (`workbench.analysis.causal`: DEPENDS, CHANCE, NO_VERDICT), and `sentence` in words.
    """

    kind: str
    layer: int
    where: str
    gain: float
    fraction: float
    controls: tuple[float, ...]
    label: str
    sentence: str


@dataclass
class PatchReport:
    """What `patch` measured: the clean and corrupted log-probabilities of the clean answer and the cells."""

    clean: float
    corrupted: float
    state_position: int
    spans: list[tuple[int, int]]
    cells: list[PatchCell] = field(default_factory=list)
    groups: list[PatchCell] = field(default_factory=list)
    forked_at: int = 0
    tokens_run: int = 0

    def grid(self, kind: str) -> tuple[list[int], list[str], np.ndarray]:
        """(layers, columns, fractions `[layers, columns]`, NaN where not measured): the layer x head map
        for "kda", the layer x span map for the others."""
        cells = [c for c in self.cells if c.kind == kind]
        layers = sorted({c.layer for c in cells})
        cols = list(dict.fromkeys(c.where for c in cells))
        out = np.full((len(layers), len(cols)), np.nan)
        for c in cells:
            out[layers.index(c.layer), cols.index(c.where)] = c.fraction
        return layers, cols, out

    def text(self) -> str:
        lines = [f"clean answer log-prob {self.clean:.3f}, corrupted {self.corrupted:.3f} "
                 f"(gap {self.clean - self.corrupted:.3f} nats); forked at position {self.forked_at}, "
                 f"{self.tokens_run:,} tokens run"]
        for kind in dict.fromkeys(c.kind for c in self.cells):
            layers, cols, grid = self.grid(kind)
            across = "head" if kind == "kda" else "span"
            lines.append(f"{kind}: fraction of the clean log-prob restored (layer x {across})")
            lines.append("layer " + " ".join(f"{c:>12}" for c in cols))
            for layer, row in zip(layers, grid):
                lines.append(f"{layer:>5} " + " ".join(f"{v:>12.0%}" if v == v else f"{'-':>12}" for v in row))
        lines += [g.sentence for g in self.groups]
        return "\n".join(lines)


def _ids(session: Session, value: Any, what: str) -> list[int]:
    if isinstance(value, str):
        if session.tokenizer is None:
            raise InputError(f"{what}= is text but the session has no tokenizer: give token ids")
        return session.tokenizer.encode(value)
    try:
        ids = [int(i) for i in value]
    except (TypeError, ValueError):
        raise InputError(f"{what}= must be text or token ids, got {type(value).__name__}") from None
    if not ids:
        raise InputError(f"{what}= is empty")
    return ids


def _score(branch: Session, answer_at: int, answer: list[int]) -> float:
    """Sum of log p(answer) of a branch whose tokens end with the answer at `answer_at` (teacher forced)."""
    if branch.length < answer_at:
        branch.prefill(until=answer_at - 1)
        logits = branch.prefill(return_logits=True)
    else:  # forked at the prompt's end: its last logits predict the answer's first token
        assert branch.last_logits is not None
        logits = torch.cat((branch.last_logits[None], branch.prefill(return_logits=True)))
    assert logits is not None
    logp = torch.log_softmax(logits[: len(answer)].float(), -1)
    return float(logp[torch.arange(len(answer)), torch.tensor(answer)].sum())


class _Corrupted:
    """The corrupted run, advanced once; a fork at a later position costs only the tokens between, one at
    an earlier position continues from the nearest fork before it."""

    def __init__(self, base: Session) -> None:
        self.run = base
        self.forks: dict[int, Session] = {}
        self.tokens_run = 0

    def at(self, position: int) -> Session:
        if position not in self.forks:
            if position >= self.run.length:
                source, self.run = self.run, self.run.fork()
            else:
                source = self.forks[max(p for p in self.forks if p <= position)].fork()
            self.tokens_run += position - source.length
            source.prefill(until=position)
            self.forks[position] = source
        return self.forks[position].fork()


def _restore_rows(clean: torch.Tensor, positions: np.ndarray, span: tuple[int, int]):
    """A forward hook writing the clean rows of `span` (rows `clean[:, i]` at `positions[i]`) into its output."""
    lookup = {int(p): i for i, p in enumerate(positions)}

    def fn(module, args, out: torch.Tensor) -> torch.Tensor:
        start, T = int(module.start), out.shape[1]
        lo, hi = max(span[0], start), min(span[1], start + T)
        if lo >= hi:
            return out
        rows = torch.tensor([lookup[p] for p in range(lo, hi)])
        out = out.clone()
        out[:, lo - start: hi - start] = clean[:, rows].to(out.device, out.dtype)
        return out
    return fn


def _sentence(what: str, gain: float, fraction: float, controls: Sequence[float], fractions: Sequence[float],
              unit: str) -> tuple[str, str]:
    """The restoration's verdict: `verdict`'s rule on the negated gains (a restoration is the mirror of a
    removal: it counts when it raises the answer beyond every control by the same margin)."""
    v = verdict(-gain, [-c for c in controls], what, unit=unit)
    head = f"restoring {what} recovered {fraction:.0%} of the clean answer's log-probability ({gain:+.2f} nats)"
    if fractions:
        head += (f"; {len(fractions)} random {unit}{'s' if len(fractions) != 1 else ''} of the same size recovered "
                 f"{min(fractions):.0%} to {max(fractions):.0%}")
    if v.label == DEPENDS:
        return v.label, f"{head}: {what} carries what the answer needs"
    if v.label == NO_VERDICT:
        return v.label, f"{head}; no verdict: {v.sentence.split('no verdict: ', 1)[-1]}"
    return v.label, f"{head}: not distinguishable from a random {unit} of the same size"


def patch(session: Session, clean: Any, corrupted: Any, answer: Any, *, kinds: Sequence[str] = KINDS,
          layers: Sequence[int] | None = None, spans: Sequence[tuple[int, int]] | None = None,
          state_position: int | None = None, controls: int = DEFAULT_CONTROLS, group: int = 2,
          seed: int = 0) -> PatchReport:
    """Restore clean activations into a corrupted run, one at a time (module doc).

    Args:
        session: holds the shared context (kept as it is: every run is a fork of it).
        clean, corrupted: the prompts appended after the session's context (text or ids), the same length.
        answer: the clean answer (text or ids), scored after the prompt.
        kinds: which restorations to run (`KINDS`).
        layers: the layers to restore (default: every layer of each kind).
        spans: absolute [start, end) spans for resid, dsa and experts (default: the differing span and
            the prompt's last position).
        state_position: the position after which a KDA head's state is restored (default: the last
            differing one).
        controls: random restorations of the same size per cell (spans; 0: none).
        group: the best this many KDA heads are also restored together beside random sets of as many.
    """
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise InputError(f"kinds= holds {unknown}; known: {', '.join(KINDS)}")
    model, config = session.model, session.model.config
    clean_ids, bad_ids = _ids(session, clean, "clean"), _ids(session, corrupted, "corrupted")
    answer_ids = _ids(session, answer, "answer")
    if len(clean_ids) != len(bad_ids):
        raise InputError(f"clean and corrupted prompts must be the same length, got {len(clean_ids)} and "
                         f"{len(bad_ids)} tokens")
    differ = [i for i, (a, b) in enumerate(zip(clean_ids, bad_ids)) if a != b]
    if not differ:
        raise InputError("the clean and corrupted prompts are the same: nothing to restore")
    off = len(session.tokens)
    diff_span = (off + differ[0], off + differ[-1] + 1)
    prompt_end = off + len(clean_ids)
    answer_at = prompt_end
    state_at = diff_span[1] - 1 if state_position is None else int(state_position)
    if not diff_span[0] <= state_at < prompt_end:
        raise InputError(f"state_position={state_position} must lie in [{diff_span[0]}, {prompt_end}): after the "
                         "first difference, inside the prompt")
    spans = [diff_span, (prompt_end - 1, prompt_end)] if spans is None else [(int(a), int(b)) for a, b in spans]
    for a, b in spans:
        if not diff_span[0] <= a < b <= prompt_end:
            raise InputError(f"span {a}:{b} must lie inside [{diff_span[0]}, {prompt_end}) (from the first "
                             "difference to the prompt's end)")
    chosen = None if layers is None else set(layers)
    if chosen is not None and not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool)
                                      and 0 <= i < config.num_hidden_layers for i in chosen):
        raise InputError(f"layers= must be layer numbers in [0, {config.num_hidden_layers}), got {sorted(chosen, key=str)}")

    def layers_of(kind: str) -> list[int]:
        every = range(config.num_hidden_layers)
        if kind == "kda":
            out = [i for i in every if config.is_kda_layer(i)]
        elif kind == "dsa":
            out = [i for i in every if config.is_dsa_layer(i)]
        elif kind == "experts":
            out = [i for i in every if config.is_moe_layer(i)]
        else:
            out = list(every)
        return [i for i in out if chosen is None or i in chosen]

    base = session.fork()
    if differ[0]:
        base.append(ids=clean_ids[: differ[0]], name="shared prompt")
    base.prefill()
    forked_at = base.length

    # the clean run: its answer log-prob, its KDA states after state_at, and the rows the spans restore
    clean_run = base.fork()
    clean_run.append(ids=clean_ids[differ[0]:] + answer_ids, name="clean")
    draws = {span: control_spans(span[1] - span[0], (diff_span[0], prompt_end), [span, diff_span], controls, seed)
             for span in spans}
    kept = [np.arange(a, b) for span in spans for a, b in (span, *draws[span].spans)]
    span_positions = np.unique(np.concatenate(kept))
    names = [f"blocks.{i}.{POINT[k]}" for k in ("resid", "dsa", "experts") if k in kinds for i in layers_of(k)]
    collector = RowCollector(span_positions, 2**62, None)
    with hooks(model, [(n, collector.hook(n, False)) for n in names]):
        clean_run.prefill(until=state_at + 1)
        clean_states = {i: s.recurrent.clone() for i, s in enumerate(clean_run.state.layers) if isinstance(s, KDAState)}
        clean_lp = _score(clean_run, answer_at, answer_ids)
    rows = collector.result()
    tokens_run = clean_run.length - forked_at

    bad = base.fork()
    bad.append(ids=bad_ids[differ[0]:] + answer_ids, name="corrupted")
    corrupted_run = _Corrupted(bad)
    corrupt_lp = _score(corrupted_run.at(forked_at), answer_at, answer_ids)
    tokens_run += len(bad_ids) - differ[0] + len(answer_ids)
    gap = clean_lp - corrupt_lp
    report = PatchReport(clean_lp, corrupt_lp, state_at, spans, forked_at=forked_at)

    def fraction(gain: float) -> float:
        return gain / gap if abs(gap) > 1e-9 else float("nan")

    def run_restoration(start: int, edit=None, hook=None) -> float:
        nonlocal tokens_run
        branch = corrupted_run.at(start)
        tokens_run += len(branch.tokens) - start
        if edit is not None:
            edit(branch)
        if hook is None:
            return _score(branch, answer_at, answer_ids) - corrupt_lp
        with hooks(model, [hook]):
            return _score(branch, answer_at, answer_ids) - corrupt_lp

    # KDA heads: the clean state of one head written into the corrupted state after state_at
    heads: list[tuple[int, int]] = [(i, h) for i in layers_of("kda") if "kda" in kinds
                                    for h in range(clean_states[i].shape[1])]

    def restore_heads(chosen_heads: Sequence[tuple[int, int]]):
        def edit(branch: Session) -> None:
            with torch.inference_mode():
                for i, h in chosen_heads:
                    state = branch.state.layers[i]
                    rec = state.recurrent.clone()
                    rec[:, h] = clean_states[i][:, h].to(rec.device, rec.dtype)
                    state.recurrent = rec
        return edit

    head_gain = {hd: run_restoration(state_at + 1, restore_heads([hd])) for hd in heads}
    for (i, h), gain in head_gain.items():
        others = [g for o, g in head_gain.items() if o != (i, h)]
        label, sentence = _sentence(f"KDA layer {i} head {h}'s state after position {state_at}", gain,
                                    fraction(gain), others, [fraction(g) for g in others], "head")
        report.cells.append(PatchCell("kda", i, f"head {h}", gain, fraction(gain),
                                      tuple(fraction(g) for g in others), label, sentence))
    if heads and 0 < group < len(heads):
        best = sorted(heads, key=lambda hd: -head_gain[hd])[:group]
        rest = [hd for hd in heads if hd not in best]
        sets = list(itertools.combinations(rest, group))
        rng = np.random.default_rng(seed)
        picked = [sets[j] for j in rng.permutation(len(sets))[: max(controls, 0)]]
        gain = run_restoration(state_at + 1, restore_heads(best))
        others = [run_restoration(state_at + 1, restore_heads(list(s))) for s in picked]
        what = "KDA heads " + ", ".join(f"{i}.{h}" for i, h in best)
        label, sentence = _sentence(what, gain, fraction(gain), others, [fraction(g) for g in others],
                                    "head set")
        report.groups.append(PatchCell("kda", -1, what, gain, fraction(gain), tuple(fraction(g) for g in others),
                                       label, sentence))

    # spans: the clean rows of a layer's output, selection or routes over the span
    for kind in ("resid", "dsa", "experts"):
        if kind not in kinds:
            continue
        for i in layers_of(kind):
            name = f"blocks.{i}.{POINT[kind]}"
            clean_rows, positions = rows[name], rows.positions[name]
            for a, b in spans:
                def one(span: tuple[int, int]) -> float:
                    return run_restoration(span[0], hook=(name, _restore_rows(clean_rows, positions, span)))
                gain = one((a, b))
                draw = draws[(a, b)]
                others = [one(span) for span in draw.spans]
                what = f"{kind} of layer {i} over {a}:{b}"
                label, sentence = _sentence(what, gain, fraction(gain), others, [fraction(g) for g in others], "span")
                if not draw.enough:
                    sentence += f" ({draw.note})"
                report.cells.append(PatchCell(kind, i, f"{a}:{b}", gain, fraction(gain),
                                              tuple(fraction(g) for g in others), label, sentence))
    report.tokens_run = tokens_run + corrupted_run.tokens_run
    return report


__all__ = ["patch", "PatchReport", "PatchCell", "KINDS"]
