"""Interventions checked against a model: layers, heads, experts and positions it has, and routes it can
still take (a ban must leave a token as many experts as it uses)."""

from __future__ import annotations

from typing import Iterable, Sequence

from engine.config import ModelConfig
from engine.errors import InputError
from engine.interventions.spec import ALL, Intervention, MoeBan, MoeForce

def _layers_of(item: Intervention, config: ModelConfig, kind: str, where: str) -> tuple[int, ...]:
    test = {"dsa": config.is_dsa_layer, "kda": config.is_kda_layer, "moe": config.is_moe_layer}[kind]
    every = tuple(i for i in range(config.num_hidden_layers) if test(i))
    if not every:
        raise InputError(f"{where}: this model has no {kind.upper()} layer")
    if item.layers == ALL:
        return every
    bad = [i for i in item.layers if i not in every]
    if bad:
        raise InputError(f"{where}: layer(s) {bad} are not {kind.upper()} layers of this model; "
                         f"its {kind.upper()} layers are {list(every)}")
    return tuple(item.layers)


def check_interventions(items: Iterable[Intervention], config: ModelConfig) -> None:
    """InputError naming the first entry whose layers, heads, experts or positions the model lacks."""
    limit = config.max_position_embeddings
    for i, item in enumerate(items):
        where = f"intervention {i} ({item.op})"
        kind = item.op.split(".")[0]
        _layers_of(item, config, kind, where)
        heads = getattr(item, "heads", ALL)
        if heads != ALL and max(heads) >= config.kda_num_heads:
            raise InputError(f"{where}: head(s) {[h for h in heads if h >= config.kda_num_heads]} do not exist; "
                             f"KDA layers have {config.kda_num_heads} heads")
        experts = getattr(item, "experts", ())
        if experts and max(experts) >= config.num_experts:
            raise InputError(f"{where}: expert(s) {[e for e in experts if e >= config.num_experts]} do not exist; "
                             f"MoE layers have {config.num_experts} experts")
        if isinstance(item, MoeForce) and len(experts) > config.num_experts_per_token:
            raise InputError(f"{where}: {len(experts)} experts forced, but a token uses "
                             f"{config.num_experts_per_token}")
        span = getattr(item, "positions", None)
        at = getattr(item, "at", None)
        if (span is not None and span[0] >= limit) or (at is not None and at >= limit):
            raise InputError(f"{where}: position beyond the model's context limit {limit}")
    _check_routes(items, config)


def _check_routes(items: Sequence[Intervention], config: ModelConfig) -> None:
    """InputError when `moe.ban` / `moe.force` entries together leave a token of some MoE layer fewer experts
    to route to than it uses (a top-k over too few would pick banned experts), or force more than it uses.
    Bans and forces over overlapping positions add up; a forced expert is routable even when banned."""
    routed = [(i, item) for i, item in enumerate(items) if isinstance(item, (MoeBan, MoeForce))]
    if not routed:
        return
    far = config.max_position_embeddings
    every = tuple(i for i in range(config.num_hidden_layers) if config.is_moe_layer(i))
    by_layers: dict[tuple[int, ...], list[int]] = {}  # the entries acting on a layer -> those layers
    for layer in every:
        acting = tuple(n for n, (_, item) in enumerate(routed) if item.layers == ALL or layer in item.layers)
        if acting:
            by_layers.setdefault(acting, []).append(layer)
    for acting, layers in by_layers.items():
        # sweep the positions: at each start / end the counts of bans and forces per expert change
        events: dict[int, list[tuple[int, int]]] = {}
        for n in acting:
            start, end = routed[n][1].positions or (0, far)
            events.setdefault(start, []).append((n, 1))
            events.setdefault(min(end, far), []).append((n, -1))
        banned = [0] * config.num_experts
        forced = [0] * config.num_experts
        blocked = pinned = 0  # experts banned and not forced; experts forced (kept as the counts change)
        active: set[int] = set()
        for position in sorted(events):
            for n, step in events[position]:
                item = routed[n][1]
                counts = banned if isinstance(item, MoeBan) else forced
                for e in item.experts:
                    was_blocked, was_pinned = banned[e] > 0 and forced[e] == 0, forced[e] > 0
                    counts[e] += step
                    blocked += (banned[e] > 0 and forced[e] == 0) - was_blocked
                    pinned += (forced[e] > 0) - was_pinned
                (active.add if step > 0 else active.discard)(n)
            if position >= far or not active:
                continue
            tight = blocked > config.num_experts - config.num_experts_per_token or pinned > config.num_experts_per_token
            grouped = config.num_expert_group > 1 and config.topk_group < config.num_expert_group
            refused = _route_shortfall(banned, forced, config) if tight or grouped else None
            if refused:
                shown = sorted(active)
                names = ", ".join(f"{routed[n][0]} ({routed[n][1].op})" for n in shown[:4]) + \
                    (f" and {len(shown) - 4} more" if len(shown) > 4 else "")
                raise InputError(f"intervention{'s' if len(shown) > 1 else ''} {names}: on MoE layer "
                                 f"{layers[0]}{' (and ' + str(len(layers) - 1) + ' more)' if len(layers) > 1 else ''}"
                                 f" from position {position}, {refused}")


def _route_shortfall(banned: Sequence[int], forced: Sequence[int], config: ModelConfig) -> str | None:
    """Why the router cannot pick `experts_per_token` experts with these per-expert ban / force counts
    (None when it can). With group-limited routing the worst groups the router could keep are counted."""
    k, total = config.num_experts_per_token, config.num_experts
    n_forced = sum(1 for f in forced if f > 0)
    if n_forced > k:
        return f"{n_forced} experts are forced but a token uses {k} (experts_per_token)"
    allowed = [b == 0 or f > 0 for b, f in zip(banned, forced)]
    left = sum(allowed)
    if left < k:
        return (f"{total - left} of its {total} experts are banned, leaving {left} to route to, but a token uses {k} "
                f"(experts_per_token): ban at most {total - k}")
    groups, keep = config.num_expert_group, config.topk_group
    if groups > 1 and keep < groups:
        size = total // groups
        counts = sorted(sum(allowed[g * size:(g + 1) * size]) for g in range(groups))
        live = [c for c in counts if c >= 2]  # a group's score is its best two experts: fewer is -inf
        dead = [c for c in counts if c < 2]
        worst = sum(live[:keep]) + sum(dead[:max(0, keep - len(live))])
        if worst < k:
            return (f"the bans leave {worst} routable experts in the {keep} of {groups} expert groups the router "
                    f"may keep, but a token uses {k} (experts_per_token)")
    return None
