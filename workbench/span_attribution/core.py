"""`attribute(...)`: which spans of the context the answer came from (the package doc says how)."""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from engine.errors import InputError
from workbench.analysis.causal import ACTION_WORDS, DEFAULT_CONTROLS, control_spans, verdict
from workbench.span_attribution.reads import reads_in, score_with_reads
from workbench.span_attribution.result import CHECKED, ESTIMATED, UNREAD, UNVARIED, Attribution, SpanEffect
from workbench.span_attribution.spans import automatic_spans, given_spans, span_text
from workbench.span_attribution.surrogate import fit, held_out_predictions, random_masks, spearman
from workbench.causal.stop import ShouldStop, check_should_stop, stop_if_asked
from workbench.causal_effects import (Continuation, _continue, _ids, _scaffold_warning, target_logprobs,
                                      task_scoring)
from workbench.interventions import check_continuation, check_seed
from workbench.task_templates import TaskPrompt, recorded_spans

DEFAULT_MASKS = 64     # random masks (ContextCite's default order of magnitude) ...
DEFAULT_HOLDOUT = 16   # ... and further ones: all are measured, fitted and held out in turn for the LDS
LDS_FOLDS = 5          # the LDS's folds: each mask predicted by a surrogate fitted on the other four fifths
DEFAULT_TOP = 8        # spans checked exactly, one by one, beside their controls
# spans the masks vary at most: a mask is one spec of at most 1,024 entries (two per range with `kda`);
# beyond this the spans read least are left out of the masks (the result's notes say how many)
MAX_CANDIDATES = 384
KEPT_STATES = 8        # forks kept inside the context for `kda` reruns (each a copy of the state at its point)
KEPT_BYTES = 1 << 30   # ... and the model state they hold together at most
MAX_MASKS = 4096


def _count(value: Any, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise InputError(f"{what} must be an integer in [{low}, {high}], got {value!r:.40}")
    return int(value)


def _merged(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _spec(ranges: Sequence[tuple[int, int]], kda: bool) -> list[dict]:
    """Hide the ranges from every DSA layer (and suppress every KDA head's writes over them with `kda`)."""
    spec = []
    for a, b in _merged(ranges):
        spec.append({"op": "dsa.hide", "positions": [a, b], "layers": "all"})
        if kda:
            spec.append({"op": "kda.suppress_writes", "positions": [a, b], "layers": "all"})
    return spec


class _Runner:
    """Scores specs from the right fork: the end of the context (DSA only), or the latest kept state at or
    before the first suppressed write (`kda`: the context after it is re-run). Before each run it asks
    `should_stop` (`workbench.causal.stop`): a stop lands between two continuations, never inside one."""

    def __init__(self, end_fork: Any, kept: dict[int, Any], continuation: Any, target: list[int], role: str,
                 kda: bool, plain: float, should_stop: ShouldStop | None = None) -> None:
        self.end_fork, self.kept, self.kda = end_fork, kept, kda
        self.continuation, self.target, self.role, self.plain = continuation, target, role, plain
        self.should_stop = should_stop
        self.runs = 0
        self.planned = 0  # the runs the attribution makes at most (what a stop reports it was cut from)

    def stop_if_asked(self) -> None:
        stop_if_asked(self.should_stop, "attribution", self.runs, self.planned, exact=False)

    def logprob(self, ranges: Sequence[tuple[int, int]]) -> float:
        if not ranges:
            return self.plain
        base = self.end_fork
        if self.kda:
            first = min(a for a, _ in ranges)
            base = self.kept[max(p for p in self.kept if p <= first)]
        self.stop_if_asked()
        self.runs += 1
        return float(target_logprobs(base, _spec(ranges, self.kda), self.continuation, self.target, self.role).sum())


def _answer(base: Any, continuation: Any, role: str, max_new_tokens: int, expected: str | None
            ) -> tuple[str, bool | None, list[int]]:
    """The plain answer (greedy, up to the response's close tag), whether it holds the expected value, and
    its ids."""
    branch = base.fork()
    branch.progress = False
    _continue(branch, continuation, role)
    tokenizer = branch.tokenizer
    close = getattr(tokenizer, "close_id", None)
    ids = []
    for token in branch.generate(max_new_tokens, temperature=0.0, add_generation_prompt=False):
        if token.id == close:
            break
        ids.append(token.id)
    text = tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))
    if isinstance(continuation, TaskPrompt):
        from workbench.retrieval_text import response_value

        text = continuation.prefix + text
        right = None if expected is None else response_value(text, continuation.style) == expected
        return text, right, ids
    return text, None, ids


def _keep_states(session: Any, starts: Sequence[int], count: int) -> tuple[dict[int, Any], float]:
    """Prefill `session` to the end, keeping forks at up to `count` of `starts` (evenly spread, within
    KEPT_BYTES) and at its current position; returns them and the seconds spent prefilling."""
    from workbench.causal.reruns import state_bytes

    kept: dict[int, Any] = {session.length: session.fork()}
    spent, held = 0.0, 0
    points = sorted({p for p in starts if p > session.length})
    if points and count > 0:
        picks = np.unique(np.linspace(0, len(points) - 1, min(count, len(points))).round().astype(int))
        for i in picks:
            t0 = time.perf_counter()
            session.prefill(until=points[i])
            spent += time.perf_counter() - t0
            cost = state_bytes(session)
            if held + cost > KEPT_BYTES:
                break
            kept[points[i]] = session.fork()
            held += cost
    t0 = time.perf_counter()
    session.prefill()
    return kept, spent + time.perf_counter() - t0


def attribute(session: Any, *, continuation: Continuation | TaskPrompt | str | Sequence[int] | None,
              target: str | Sequence[int] | None = None, spans: str | Sequence[Any] = "sentences",
              kda: bool = False, masks: int = DEFAULT_MASKS, holdout: int = DEFAULT_HOLDOUT, top: int = DEFAULT_TOP,
              controls: int = DEFAULT_CONTROLS, seed: int = 0, role: str = "user",
              evidence: Sequence[tuple[int, int]] | None = None, max_new_tokens: int = 24,
              should_stop: ShouldStop | None = None) -> Attribution:
    """Which spans of `session`'s context the answer came from; see `workbench.span_attribution` (the package doc).

    Args:
        session: holds the context (appended; prefilled or not: it is prefilled here, and the prefill is
            timed when it starts from nothing). With `kda` it must not have consumed past the first span.
        continuation, target, role: as `workbench.effects` (a `TaskPrompt` scores its expected value where
            the model writes it).
        spans: "sentences" (default), "paragraphs", "segments", or a list of (start, end) / (label, start,
            end) token spans (end exclusive). Image segments are cut into groups of patch rows.
        kda: also suppress KDA writes over hidden spans (each mask re-runs the context from its earliest
            hidden span, from the latest state kept before it).
        masks, holdout: random masks measured (masks + holdout in all): the surrogate is fitted on all of
            them, and its LDS is the Spearman correlation over all of them of each mask's prediction by a
            surrogate fitted without it (5 folds) against its measured log-probability.
        top: spans checked exactly, one by one (the surrogate's largest estimated drops), each beside
            `controls` disjoint random spans of its length (never over it or the answer's `evidence`).
        seed: the masks' and controls' seed (deterministic).
        evidence: spans no control may touch (default: the fact and its restatements a task template
            recorded on the session).
        max_new_tokens: the plain answer's length at most.
        should_stop: asked before each continuation (and before the plain answer is generated), never
            inside one; True stops the attribution there with `workbench.causal.stop.Cancelled` ("attribution
            cancelled after N of up to M runs"): nothing is returned, and the session keeps what it had
            prefilled (the dashboard's Stop).

    Returns:
        `Attribution` (workbench.span_attribution.result): the answer, `target_logprob`, `lds`, `prefill_s`,
        `attribution_s`, and `spans` (`SpanEffect`: start, end, text, effect, control range, verdict, source)
        ordered by effect, largest drop first: the spans checked exactly first, then the others by their
        estimated effect (an unchecked estimate never outranks a measured one). InputError before anything
        runs for an empty context, no target, a span or evidence out of range, a model without DSA layers,
        or bad counts (and for a `should_stop` that is not callable).
    """
    continuation, target = task_scoring(continuation, target)
    end = len(session.tokens)
    if end == 0:
        raise InputError("the context is empty: append the documents to attribute an answer to first")
    if target is None:
        raise InputError("attribute needs a target: the answer (text or token ids) whose log-probability is "
                         "measured (give target=, or a find-fact task with an expected value)")
    check_continuation(session, continuation, role)
    if not isinstance(kda, bool):
        raise InputError(f"kda must be True or False, got {kda!r:.40}")
    masks = _count(masks, "masks", 4, MAX_MASKS)
    holdout = _count(holdout, "holdout", 0, MAX_MASKS)
    if masks + holdout < 2 * LDS_FOLDS:
        raise InputError(f"masks + holdout must be at least {2 * LDS_FOLDS} (the LDS's {LDS_FOLDS} folds), got "
                         f"{masks + holdout}")
    top = _count(top, "top", 0, MAX_CANDIDATES)
    controls = _count(controls, "controls", 1, 64)
    seed = check_seed(seed)
    should_stop = check_should_stop(should_stop)
    config = session.config
    if not any(config.is_dsa_layer(i) for i in range(config.num_hidden_layers)):
        raise InputError("this model has no DSA layer: attribution hides spans from DSA layers")
    target_ids = _ids(session, target)
    assert target_ids is not None
    made = automatic_spans(session, spans, end) if isinstance(spans, str) else given_spans(spans, end)
    if not made:
        raise InputError("no span to attribute: the context holds no tokens in any segment")
    if evidence is None:
        evidence = list(recorded_spans(session).values())
    try:
        evidence = [(s.start, s.end) for s in given_spans(list(evidence), end)] if evidence else []
    except (InputError, TypeError) as exc:
        raise InputError(f"evidence (spans no control may touch): {exc}") from None
    if kda and session.length > min(s.start for s in made):
        raise InputError(f"kda: the session has consumed {session.length} tokens, past the first span's start "
                         f"({min(s.start for s in made)}); KDA writes there can only be suppressed from a session "
                         "prefilled less far (pass it before prefill)")

    fresh = session.length == 0
    kept, prefill_s = _keep_states(session, [s.start for s in made] if kda else [], KEPT_STATES)
    t0 = time.perf_counter()
    # before the reads are known, the runs at most: the plain one, every mask, every checked span and its controls
    stop_if_asked(should_stop, "attribution", 0, 1 + masks + holdout + top * (1 + controls), exact=False)
    plain_scores, counts = score_with_reads(session, continuation, target_ids, role, end)
    plain = float(plain_scores.sum())
    runner = _Runner(session, kept, continuation, target_ids, role, kda, plain, should_stop)
    runner.runs = 1
    notes: list[str] = []

    reads = np.array([reads_in(counts, s.start, s.end) for s in made])
    candidates = list(range(len(made))) if kda else [i for i in range(len(made)) if reads[i] > 0]
    if not kda and len(candidates) < len(made):
        notes.append(f"{len(made) - len(candidates)} of {len(made)} spans were never read by a DSA layer while "
                     "answering: hiding one of them alone cannot change the answer (effect 0, exact, not run)")
    if len(candidates) > MAX_CANDIDATES:
        order = sorted(candidates, key=lambda i: -reads[i])
        left_out = len(candidates) - MAX_CANDIDATES
        candidates = sorted(order[:MAX_CANDIDATES])
        notes.append(f"{left_out} spans read least were kept in every mask (at most {MAX_CANDIDATES} vary)")

    # the masks: each varied span kept with probability 1/2, one continuation per mask
    rng = np.random.default_rng(seed)
    matrix = random_masks(masks + holdout, len(candidates), rng)
    # a mask that hides nothing is the plain run (not run again); an unread control is 0 (not run either)
    runner.planned = (1 + (int((~matrix).any(axis=1).sum()) if candidates else 0)
                      + min(top, len(candidates)) * (1 + controls))
    measured = np.array([runner.logprob([(made[candidates[j]].start, made[candidates[j]].end)
                                         for j in np.flatnonzero(~row)]) for row in matrix]) \
        if candidates else np.zeros(len(matrix))
    # the surrogate is fitted on every measured mask; its LDS is taken over all of them too, each mask
    # predicted by a fit on the other folds (one held-out set of 16 masks left the LDS to the luck of how
    # many of them hid the one span that matters: 0.43 to 0.77 at 32K on the demo)
    surrogate = fit(matrix, measured, seed=seed) if candidates else None
    lds = None
    predicted = np.full(len(measured), np.nan)
    if surrogate is not None:
        predicted = held_out_predictions(matrix, measured, surrogate.alpha, LDS_FOLDS, seed)
        lds = spearman(predicted, measured)
        surrogate.lds = lds
    estimate = np.zeros(len(made))
    if surrogate is not None:
        estimate[candidates] = -surrogate.weights
    if candidates and lds is None:
        notes.append("LDS undefined: the held-out masks all scored the same (or the surrogate predicts one value)")

    # exact checks: the largest estimated drops, each beside disjoint same-size controls
    ranked = sorted(candidates, key=lambda i: (estimate[i], -reads[i], made[i].start))
    action = ACTION_WORDS["dsa.hide"] if not kda else "hiding (and suppressing the KDA writes over)"
    results: dict[int, SpanEffect] = {}
    for n, i in enumerate(ranked[:top]):
        span = made[i]
        effect = runner.logprob([(span.start, span.end)]) - plain
        draw = control_spans(span.end - span.start, (0, end), [(span.start, span.end), *evidence], controls,
                             seed + 1 + n)
        # a control no DSA layer read changes nothing through DSA hiding (the same argument as above)
        fx = [runner.logprob([c]) - plain if kda or reads_in(counts, *c) > 0 else 0.0 for c in draw.spans]
        found = verdict(effect, fx, f"tokens {span.start}:{span.end} ({span.label})", note=draw.note, action=action)
        results[i] = SpanEffect(span.start, span.end, span.label, span.kind, span_text(session, span), effect,
                                float(estimate[i]), min(fx, default=np.nan), max(fx, default=np.nan), len(fx),
                                found.rank, found.p_value, found.sentence, found.label, int(reads[i]), CHECKED)
    lds_words = "not measured" if lds is None else f"{lds:.2f}"
    varied = set(candidates)
    for i, span in enumerate(made):
        if i in results:
            continue
        unread = not kda and reads[i] == 0
        if unread:
            sentence, source = ("no DSA layer read any of its tokens while answering: hiding it alone cannot change "
                                "the answer"), UNREAD
        elif i not in varied:
            sentence, source = (f"read by only {reads[i]} selection(s): kept in every mask (at most {MAX_CANDIDATES} "
                                "spans vary), neither estimated nor checked"), UNVARIED
        else:
            sentence, source = (f"not checked one by one: the surrogate estimates {estimate[i]:+.3f} nats (its LDS on "
                                f"held-out masks: {lds_words})"), ESTIMATED
        results[i] = SpanEffect(span.start, span.end, span.label, span.kind, span_text(session, span),
                                float(estimate[i]), float(estimate[i]), verdict=sentence, reads=int(reads[i]),
                                source=source)
    runner.stop_if_asked()
    answer, right, answer_ids = _answer(session, continuation, role, max_new_tokens,
                                        continuation.expected if isinstance(continuation, TaskPrompt) else None)
    scaffold = _scaffold_warning(session.tokenizer, answer_ids, target_ids)
    if scaffold:  # the figures then say nothing about the answer (docs/interventions.md)
        notes.append(scaffold)
    # the checked spans (exact effects) first, then the rest by effect (the surrogate's estimate, or 0 unread)
    order = sorted(results.values(), key=lambda s: (s.source != CHECKED, s.effect, s.start))
    target_text = target if isinstance(target, str) else (
        session.tokenizer.decode(target_ids) if session.tokenizer is not None else str(target_ids))
    return Attribution(answer=answer, right=right, target=target_text, target_ids=target_ids, target_logprob=plain,
                       lds=lds, prefill_s=prefill_s if fresh else None, attribution_s=time.perf_counter() - t0,
                       spans=order, masks=masks, holdout=holdout, candidates=len(candidates), runs=runner.runs,
                       kda=kda, end=end, mask_matrix=matrix, mask_logprobs=measured,
                       mask_predictions=predicted,
                       candidate_spans=[(made[i].start, made[i].end) for i in candidates], notes=notes)


__all__ = ["attribute", "DEFAULT_MASKS", "DEFAULT_HOLDOUT", "DEFAULT_TOP", "MAX_CANDIDATES"]
