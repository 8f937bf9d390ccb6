"""Pure analysis functions over trace tables (numpy arrays, pandas DataFrames, Arrow tables): no I/O.

Shared by notebooks, the CLI and the dashboard; each function's docstring names the question of
spec section 6 it answers. `binning` and `reads` hold what the dashboard draws (screen bins, the
read-out of one token), so a notebook can draw the same.
"""

from workbench.analysis.binning import bin_counts, bin_mean, carry_forward
from workbench.analysis.chance import chance_of_hit, expected_hits, expected_key_selections, format_hits, format_read
from workbench.analysis.read_comparison import read_changes, reads_vs_chance
from workbench.analysis.dsa import (dense_mass_summary, distance_summary, image_patch_reads, layers_reading,
                                    queries_per_position, rebin_counts, segment_reads, sink_eviction)
from workbench.analysis.dsa_structure import (chance_jaccard, cross_layer_jaccard, faithfulness, jaccard, locality,
                                              sink_over_time)
from workbench.analysis.image_reads import PatchReads, format_patches, image_grid, patch_reads
from workbench.analysis.kda import half_decay_tokens, head_dynamics, rank_heads
from workbench.analysis.kda_health import (HEALTH_STATS, decay_timescales, effective_rank, half_lives,
                                           health_of_layers, heads_at_risk, memory_health, write_vs_forget)
from workbench.analysis.moe import (expert_imbalance, expert_shares, js_chance, js_divergence, modality_divergence,
                                    rank_load_balance)
from workbench.analysis.reads import TokenText, segment_name, token_reads
from workbench.analysis.recorded import check_dsa_layers, recorded_setting
from workbench.recorded_settings import settings_of

__all__ = [
    "PatchReads", "TokenText", "bin_counts", "bin_mean", "carry_forward", "chance_jaccard", "chance_of_hit",
    "check_dsa_layers", "recorded_setting", "settings_of",
    "cross_layer_jaccard", "decay_timescales", "dense_mass_summary", "distance_summary", "effective_rank",
    "expected_hits", "expected_key_selections", "expert_imbalance", "expert_shares", "faithfulness", "format_hits", "format_patches",
    "format_read", "HEALTH_STATS", "half_decay_tokens", "half_lives", "health_of_layers", "head_dynamics", "heads_at_risk", "image_grid",
    "image_patch_reads", "jaccard", "js_chance", "js_divergence", "layers_reading", "locality", "memory_health",
    "modality_divergence", "patch_reads", "queries_per_position", "rank_heads", "rank_load_balance", "read_changes", "reads_vs_chance",
    "rebin_counts", "segment_name",
    "segment_reads", "sink_eviction", "sink_over_time", "token_reads", "write_vs_forget",
]
