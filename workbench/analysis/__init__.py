"""Pure analysis functions over trace tables (numpy arrays, pandas DataFrames, Arrow tables): no I/O.

Shared by notebooks, the CLI and the dashboard; each function's docstring names the question of
spec section 6 it answers.
"""

from workbench.analysis.dsa import (dense_mass_summary, distance_summary, image_patch_reads, layers_reading,
                                    rebin_counts, segment_reads, sink_eviction)
from workbench.analysis.kda import half_decay_tokens, head_dynamics, rank_heads
from workbench.analysis.moe import (expert_imbalance, expert_shares, js_divergence, modality_divergence,
                                    rank_load_balance)

__all__ = [
    "dense_mass_summary", "distance_summary", "expert_imbalance", "expert_shares", "half_decay_tokens",
    "head_dynamics", "image_patch_reads", "js_divergence", "layers_reading", "modality_divergence",
    "rank_heads", "rank_load_balance", "rebin_counts", "segment_reads", "sink_eviction",
]
