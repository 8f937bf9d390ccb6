"""A session's active interventions (`Session.set_interventions`) and the record of them.

The session holds one `InterventionPlan` and hands it to the model around each of its forward calls
(`model.runtime.interventions`), so two sessions of one model never see each other's. The record
(`session.intervention_log`, kept in snapshots) lists every intervention that was set, with the
positions consumed while it was active: `from` (the session's length when set) to `to` (its length
when replaced; None while still active).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.interventions import (Intervention, InterventionPlan, KdaErase, KdaScale, parse_interventions,
                                  to_json)


def activate(session: Any, spec: Any) -> InterventionPlan | None:
    """Check `spec` against the session's model, close the record of the interventions it replaces and
    open theirs; return the plan (None for an empty spec). Nothing changes when a check fails.

    A `kda.erase` / `kda.scale` at a position the session has already consumed is applied now to the state
    as it is (its record says `applied_at`), unless the record shows it applied already (set again, e.g.
    restored after a `with` block); later ones apply when their token is consumed.
    """
    items = parse_interventions(spec)
    plan = InterventionPlan(items, session.config, session.device) if items else None
    length = session.length
    for entry in session.intervention_log:
        if entry["to"] is None:
            entry["to"] = length
    for item in items:
        entry: dict[str, Any] = {**to_json(item), "from": length, "to": None}
        if isinstance(item, (KdaErase, KdaScale)) and item.at < length and not _applied(session, item):
            _edit_state_now(session, plan, item)
            entry["applied_at"] = length - 1
        session.intervention_log.append(entry)
    return plan


def _edit_state_now(session: Any, plan: InterventionPlan, item: Intervention) -> None:
    """Multiply the recurrent state of the item's layers and heads (this rank's share) by its factor."""
    model = session.model
    for layer, rule in enumerate(plan.kda):
        if rule is None or not _names(item, layer, session.config):
            continue
        state = session.state.layers[layer]
        lo, hi = model.model.layers[layer].self_attn.head_range
        factor = torch.ones(session.config.kda_num_heads)
        heads = range(session.config.kda_num_heads) if item.heads == "all" else item.heads
        factor[list(heads)] = item.factor
        state.recurrent = state.recurrent * factor[lo:hi].to(state.recurrent.device).view(1, -1, 1, 1)


def _applied(session: Any, item: Intervention) -> bool:
    """Whether the record shows the edit `item` applied: set while its position was consumed, or applied
    when set."""
    spec = to_json(item)
    for entry in session.intervention_log:
        if {k: v for k, v in entry.items() if k in spec} != spec:
            continue
        if "applied_at" in entry or (entry["from"] <= item.at and (entry["to"] is None or entry["to"] > item.at)):
            return True
    return False


def _names(item: Intervention, layer: int, config: Any) -> bool:
    return config.is_kda_layer(layer) and (item.layers == "all" or layer in item.layers)

