"""The decode step: one token for every running sequence, eager or compiled.

- `step.py`: `DecodeStep` (static caches reserved ahead, one graph per shape, interventions as data).
- `layouts.py`: the weights the step reads input-major (one-row matmuls stream their rows in order).
- `probe_tape.py`: what the probes listening to a decode step receive, collected without a sync per layer.
"""
