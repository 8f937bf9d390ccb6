"""Interventions as data: what a layer may not read, what a KDA head may not remember, which experts
a token may not use.

One JSON list describes them (the command line's `--intervene SPEC.json`, the Python API, the trace):

    [{"op": "dsa.hide", "positions": [START, END], "layers": "all"},
     {"op": "kda.suppress_writes", "positions": [START, END], "layers": [4], "heads": [0, 3]},
     {"op": "kda.erase", "at": POS, "layers": "all"},
     {"op": "kda.scale", "at": POS, "factor": 0.5, "layers": [1], "heads": "all"},
     {"op": "moe.ban", "experts": [3, 7], "layers": "all", "positions": [START, END]},
     {"op": "moe.force", "experts": [1], "layers": [2]}]

Positions are token positions, end exclusive; `layers` are model layer ids (the kind must fit the op:
a DSA layer for `dsa.*`, a KDA layer for `kda.*`, an MoE layer for `moe.*`); `"all"` names every
layer (head, expert) of that kind. Segment names are resolved to positions by the caller (the
workbench); here a `"segment"` key is an error that says so.

Semantics (what the layers do with it, `InterventionPlan`):
- `dsa.hide`: keys in the range are excluded from the indexer's scores before the top-k (the layer
  reads its next-best keys instead) and masked out of dense attention. A query always keeps its own
  key, so no query is left with nothing to read.
- `dsa.pin`: visible keys in the range are always selected; the rest of the top-k is chosen as usual
  (their reported index score is +inf). Dense reads already read them: a no-op there.
- `kda.suppress_writes`: the delta-rule write strength beta is 0 for those tokens, for the chosen
  heads; the decay still runs (the short conv still sees them).
- `kda.erase` / `kda.scale`: the recurrent state of the chosen heads is multiplied by 0 / `factor`
  right after the token at `at` is consumed. Set on a session that has already consumed `at`, it
  applies once, to the state as it is then (`Session.set_interventions`).
- `moe.ban`: the router cannot pick those experts (their choice score is -inf before the top-k).
- `moe.force`: those experts are always picked (at most top-k of them); the remaining slots are
  chosen as usual; weights are the router's own scores of the chosen experts.

The plan holds small device tensors per layer (ranges padded to a fixed count), so a new
intervention of the same shape is new data for the compiled decode step, not a new graph; with
none set the layers pay one `is None` check, and so they do for a forward call the plan cannot reach
(`InterventionPlan.acts_on`: the session hands them no plan then).

A spec holds at most `MAX_INTERVENTIONS` entries naming at most `MAX_SPEC_IDS` layer, head and expert ids
in all; repeated entries count once; `moe.ban` / `moe.force` entries that together leave a token fewer
experts than it routes to (or force more) are refused, naming the layer, the position and the counts.

The package: `spec` (the dataclasses, parsing, the cost limits), `checks` (against a model's layers,
heads, experts and routes), `plan` (the per-layer tables the layers read).
"""

from engine.interventions.checks import check_interventions
from engine.interventions.plan import (DsaRule, InterventionPlan, KdaRule, MoeRule, _range_table, _row_table,
                                       in_ranges)
from engine.interventions.spec import (ALL, MAX_INTERVENTIONS, MAX_POSITION, MAX_SPEC_IDS, OPS, DsaHide, DsaPin,
                                       Intervention, KdaErase, KdaScale, KdaSuppressWrites, MoeBan, MoeForce,
                                       Selection, parse_entry, parse_interventions, to_json)

__all__ = ["ALL", "MAX_INTERVENTIONS", "MAX_POSITION", "MAX_SPEC_IDS", "OPS", "DsaHide", "DsaPin", "DsaRule",
           "Intervention", "InterventionPlan", "KdaErase", "KdaRule", "KdaScale", "KdaSuppressWrites", "MoeBan",
           "MoeForce", "MoeRule", "Selection", "check_interventions", "in_ranges", "parse_entry",
           "parse_interventions", "to_json", "_range_table", "_row_table"]
