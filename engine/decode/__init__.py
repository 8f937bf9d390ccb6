"""The decode step: one token for every running sequence, eager or compiled.

- `step.py`: `DecodeStep` (static caches reserved ahead, one graph per shape, interventions as data).
- `probe_tape.py`: what the probes listening to a decode step receive, collected without a sync per layer.
"""
