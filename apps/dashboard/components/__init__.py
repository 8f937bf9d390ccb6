"""The dashboard's views, one `pn.viewable.Viewer` each, plus the Bokeh and browser-side pieces they share.

- `session_map.SessionMap`: segments strip, prefill progress, streaming generated text.
- `dsa_map.DSAMemoryMap`: DSA selection heat map and the per-token read-out.
- `kda_state.KDAStateView`: KDA state norms per layer and per head.
- `kda_health.KDAHealthView`: heads ranked by how fast they saturate / forget, positions on the session map.
- `dsa_diff.DSADiffView`: side-by-side mode: where two traces' DSA selections differ, beside chance.
- `experts.ExpertsView`: expert usage, text vs image, per-token routes, expert-parallel load.
- `figures`, `token_strip`, `text`: heat-map figure, clickable tokens / width probe, escaped text.
"""
