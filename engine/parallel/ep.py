"""Expert parallelism: placement, dispatch/combine index maths and their byte counts (pure functions).

Placement: rank r holds the contiguous experts [r E/w, (r+1) E/w) (896 / 8 = 112 per rank).

Dispatch choice. Tensor parallelism leaves the MoE input replicated on every rank (attention ends
in an all-reduce), so every rank routes every token identically and runs only its local experts:
dispatch is a local mask and moves no bytes. Combine sums the ranks' partial routed outputs with
one all-reduce **in the latent, before `routed_expert_norm`** (3584 wide, not 7168). Per token and
MoE layer in K3.1 Pro (bf16, 8 ranks), with n = 3584 x 2 B = 7168 B:
- all-reduce (chosen): a ring all-reduce sends 2 (w-1)/w n = 12,544 B per rank, 100,352 B over the
  node; it is the bandwidth lower bound of making a sum available on every rank.
- all-to-all (tokens owned by one rank each, as in data-parallel attention): a token's experts
  sit on about 7.07 of the 8 ranks (16 of 896, uniform), 6.19 of them remote, so dispatch moves
  6.19 n = 44.4 KB and combine another 44.4 KB (88.7 KB per token), and the result then lives on
  one rank: head-sharded attention needs it on all 8 again, an all-gather of the 14,336 B hidden
  row (7 x 14,336 = 100 KB). About 189 KB per token against 100 KB, plus the permutations.
All-to-all pays off when attention is data-parallel (many sequences per step); at batch 1 over a
1M context the KDA and MLA heads must be sharded, so the all-reduce is both simpler and smaller.

`all_to_all_plan` and `combine_rows` hold the alternative's index maths so the benchmark can count
what it would move on real routing decisions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def expert_range(num_experts: int, rank: int, world: int) -> range:
    """Global ids of the experts rank `rank` holds (contiguous; `num_experts` divisible by `world`)."""
    per_rank = num_experts // world
    return range(rank * per_rank, (rank + 1) * per_rank)


def owner_rank(expert_ids: torch.Tensor, num_experts: int, world: int) -> torch.Tensor:
    """Rank holding each expert id (same shape as `expert_ids`)."""
    return expert_ids // (num_experts // world)


def local_route_mask(expert_ids: torch.Tensor, num_experts: int, rank: int, world: int) -> torch.Tensor:
    """[N, k] bool: which routes this rank computes (the whole of the chosen dispatch)."""
    return owner_rank(expert_ids, num_experts, world) == rank


def ranks_per_token(expert_ids: torch.Tensor, num_experts: int, world: int) -> torch.Tensor:
    """[N] number of distinct ranks holding the experts of each token ([N, k] ids)."""
    owners = owner_rank(expert_ids, num_experts, world)
    hit = torch.zeros(expert_ids.shape[0], world, dtype=torch.bool, device=expert_ids.device)
    hit.scatter_(1, owners, True)
    return hit.sum(-1)


def expected_ranks_per_token(num_experts: int, top_k: int, world: int) -> float:
    """E[distinct ranks hit] when a token picks `top_k` distinct experts uniformly at random."""
    per_rank = num_experts // world
    miss = math.comb(num_experts - per_rank, top_k) / math.comb(num_experts, top_k)
    return world * (1.0 - miss)


@dataclass(frozen=True)
class AllToAllPlan:
    """Rows each token sends in an all-to-all dispatch: one copy per distinct destination rank.

    Attributes:
        token: [M] token index of each row, rows grouped by destination (rank 0's first).
        dest: [M] destination rank of each row (non-decreasing).
        send_counts: [world] rows per destination (the all-to-all split sizes).
    """

    token: torch.Tensor
    dest: torch.Tensor
    send_counts: torch.Tensor


def all_to_all_plan(expert_ids: torch.Tensor, num_experts: int, world: int) -> AllToAllPlan:
    """Dispatch plan for tokens [N] with expert ids [N, k] (a token goes once to each rank it needs)."""
    owners = owner_rank(expert_ids, num_experts, world)
    n = expert_ids.shape[0]
    hit = torch.zeros(n, world, dtype=torch.bool, device=expert_ids.device)
    hit.scatter_(1, owners, True)
    dest, token = hit.t().nonzero(as_tuple=True)  # row-major over [world, N]: grouped by rank
    return AllToAllPlan(token=token, dest=dest, send_counts=hit.sum(0))


def combine_rows(rows: torch.Tensor, plan: AllToAllPlan, num_tokens: int) -> torch.Tensor:
    """Inverse of the dispatch: sum the rows [M, D] returned per destination back to tokens [N, D]."""
    out = rows.new_zeros(num_tokens, rows.shape[-1])
    return out.index_add_(0, plan.token, rows)


def ring_all_reduce_bytes(nbytes: int, world: int) -> float:
    """Bytes each rank sends in a bandwidth-optimal (ring) all-reduce of `nbytes`."""
    return 2 * (world - 1) / world * nbytes

