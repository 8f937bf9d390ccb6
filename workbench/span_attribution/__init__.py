"""Attribution over the whole context: which spans the answer came from (`workbench.attribute`, the
function; this package is not named `attribute` so that importing it never shadows the function on
the `workbench` package).

`attribute(session, continuation=task)` (or `continuation=question, target=answer`):

1. Spans: made from the context's text (`spans="sentences"`, `"paragraphs"`, `"segments"`; an image's
   patches in groups of rows) or given as (start, end) token positions, end exclusive.
2. The answer's DSA reads: one plain run of the continuation (question + target, teacher forced) from
   the end of the shared context records which context keys each DSA layer selected for those query
   rows (`reads.py`). A span no DSA layer read cannot change the answer when hidden from DSA layers
   alone: it is reported with effect 0 ("unread") and never spent a mask on.
3. Random ablation masks (ContextCite's method): each read span kept with probability 1/2 (`masks`,
   default 64 + 16 `holdout`, seeded); each mask is one `dsa.hide` spec of many ranges on a fork at the end of the
   context: only the continuation runs, never the context again. With `kda=True` the KDA writes over
   the hidden spans are suppressed too, and each mask re-runs the context from its earliest hidden
   span, from the latest state kept before it (up to 8 forks kept at span starts).
4. A sparse linear surrogate (Lasso, cross-validated penalty; `surrogate.py`, numpy) of the target's
   log-probability on the masks; its LDS (Spearman correlation of prediction vs measurement on held-out
   masks: each mask predicted by a surrogate fitted on the other folds, 5 folds over all of them) tells
   how far to trust the ranking.
5. The `top` spans with the largest estimated drops are checked exactly, one by one, each beside
   `controls` (8) disjoint random spans of the same length (`workbench.analysis.causal.control_spans`,
   never over the span or the answer's evidence) and judged by `verdict` ("the answer depends on ...").

The result, `Attribution` (`result.py`): `answer`, `right`, `target`, `target_logprob`, `lds`,
`prefill_s`, `attribution_s`, `runs`, `notes`, and `spans`: one `SpanEffect` per span (start, end,
text, effect in nats, estimate, control_min / control_max / controls, rank, p_value, verdict, reads,
source: "checked" exact with controls, "estimated" by the surrogate, "unread" exact 0), ordered by
effect, largest drop first. `to_json()` is the `workbench attribute --json` schema; the masks and
their measured log-probabilities (`mask_matrix`, `mask_logprobs`, `mask_predictions`, `candidate_spans`) are kept for
comparisons (ContextCite's own run).
"""

from __future__ import annotations

from workbench.span_attribution.core import DEFAULT_HOLDOUT, DEFAULT_MASKS, DEFAULT_TOP, attribute
from workbench.span_attribution.result import CHECKED, ESTIMATED, UNREAD, UNVARIED, Attribution, SpanEffect
from workbench.span_attribution.spans import SPAN_MODES, Span, automatic_spans, given_spans

__all__ = ["attribute", "Attribution", "SpanEffect", "Span", "automatic_spans", "given_spans", "SPAN_MODES",
           "CHECKED", "ESTIMATED", "UNREAD", "UNVARIED", "DEFAULT_MASKS", "DEFAULT_HOLDOUT", "DEFAULT_TOP"]
