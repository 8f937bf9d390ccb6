"""K3 Workbench: recorders, trace store and analysis (the `workbench` command line lives in `apps.cli`).

The engine (`engine`) runs the model; this package observes it and never the other way round.

Public API:
- `record(session, trace=DIR, signals=None, policy="default")`: a context manager that records a
  running `engine.session.Session` into a trace directory (`signals`: the families to record, default
  all; the families are `workbench.signals`, one module each).
- `open_trace(DIR)`: read a finished or live trace (`Trace.refresh()` follows a live one).
- `RecordPolicy`, `load_policy`: what is kept raw and what is only counted.
- `recorded_session(model_ref, trace, ...)`: load a model and its tokenizer, open a `Session` and
  record it, in one context manager (what `workbench run`, `workbench demo` and the dashboard's
  drive mode share).
- `ConversationTrace(session, trace, ...)`: one trace per conversation, recorded request after request
  while other conversations use the model in between (`workbench serve`).
- `intervene(session, *interventions)`: a context manager running its block with interventions on what
  the layers read, remember and route (`engine.interventions`; spec objects may name a segment).
- `effects(session, *interventions, continuation=, target=)`: the answer, a target's per-token
  log-probability and the per-step KL with and without interventions, from one shared prefix (`Effects`).
- `attribution(session, segments, continuation=, target=)`: which memory the answer depends on: each
  segment hidden from each DSA layer (KDA writes suppressed, answer experts banned), beside same-size controls.
- `attribute(session, continuation=task, spans="sentences")`: which spans of the whole context the answer
  came from: random ablation masks hidden inside the model, a sparse surrogate with its held-out LDS, the
  top spans checked one by one beside same-size controls (`Attribution`, `workbench.span_attribution`).
- `check_span(session, span, continuation=task)`: did the answer use this span? It hidden beside random
  same-size controls, with the verdict in one sentence (`workbench.causal`).
- `run_with_cache(session, names, positions=, layers=)`, `logit_lens(session, positions=)`, `patch(session, clean,
  corrupted, answer)`: named hook points cached within a memory bound, the AttnRes logit lens, activation
  patching between a clean and a corrupted run (`workbench.toolkit`, docs/hooks.md).
- `workbench.analysis`: pure functions over trace arrays (shared by notebooks, CLI and app).
- `haystack(n_tokens, tokenizer, seed)`, `plant(needle, n_tokens, tokenizer, depth, seed)`: deterministic
  filler documents, optionally with a planted needle (`workbench.text`).
- `show(trace_or_session, views=None)`: the dashboard's live views inline in a notebook cell
  (`workbench.inline`; found through the entry point group `k3_workbench.views`).
- `chart_picture(values, labels, title, caption)`: a bar chart drawn with Pillow, for image sessions
  (`workbench.pictures`); `draw_shape(rng, colour=, shape=, position=)`, `draw_digit(rng, digit=)`: the
  pictures the trained demo model answers questions about (`workbench.shape_pictures`).

Names are imported lazily: reading a trace does not import torch.
"""

from __future__ import annotations

from engine.lazy import lazy_attributes

_EXPORTS = {
    "record": "workbench.recorders", "RecordPolicy": "workbench.recorders", "load_policy": "workbench.recorders",
    "open_trace": "workbench.trace", "Trace": "workbench.trace", "TraceError": "workbench.trace",
    "TraceWriter": "workbench.trace", "haystack": "workbench.text", "plant": "workbench.text",
    "chart_picture": "workbench.pictures", "draw_shape": "workbench.shape_pictures",
    "draw_digit": "workbench.shape_pictures",
    "recorded_session": "workbench.sessions", "show": "workbench.inline",
    "intervene": "workbench.interventions", "effects": "workbench.causal_effects", "Effects": "workbench.causal_effects",
    "load_intervention_spec": "workbench.interventions",
    "attribution": "workbench.attribution", "check_span": "workbench.causal.check",
    "attribute": "workbench.span_attribution", "Attribution": "workbench.span_attribution",
    "ConversationTrace": "workbench.conversation_trace",
    "run_with_cache": "workbench.toolkit", "logit_lens": "workbench.toolkit", "patch": "workbench.toolkit",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_attributes(__name__, _EXPORTS, globals())
