"""The causal pieces of the workbench: did the answer use this span, and what-if reruns.

- `check`: `check_span(session, span, continuation=task)`: one span hidden from the DSA layers beside
  random same-size controls, with the verdict in one sentence (also `workbench.check_span`).
- `demo_check`: the demo's causal check (the needle and the picture hidden from their top reader
  and from every DSA layer, each beside its controls).
- `reruns`: drive mode's "what if" plan and run (the dashboard's panel holds only the widgets).

The control-span draw and the verdict every one of them uses are pure functions one floor down, in
`workbench.analysis.causal` (the dashboard's effects view judges stored rows with them too).
"""
