"""Runtime switches: how to compute, never what the model is (that is `ModelConfig`).

One `RuntimeOptions` object is shared by every layer of a model (`model.runtime`), so flipping a
switch affects the next forward call. Nothing here changes the checkpoint or the config hash.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.interventions import InterventionPlan


@dataclass
class RuntimeOptions:
    """Attributes:
    dsa_force_dense: every DSA layer reads every past key (K3-style reads) instead of the indexer's
        top-k; the indexer still runs so its selections can be compared (= all of dsa_dense_layers).
    dsa_dense_layers: the layer ids that read densely (K3 on those layers, K3.1 elsewhere); their
        indexer still runs and records what it would have read.
    mxfp8_activations: round routed-expert GEMM inputs through MXFP8 (training-time format).
    kda_chunk_size: tokens per chunk of the chunked KDA form.
    kda_recurrent_max_tokens: at or below this many new tokens KDA steps token by token.
    expert_cache_mib: budget for dequantized MXFP4 experts kept between calls (the packed copy is
        always kept; hot experts skip dequantization on the next token). 0 = dequantize at every use.
    kernels: "auto" runs the Triton kernels on CUDA tensors; "reference" forces the pure-torch ops.
    compile: the session's single-token decode step runs `torch.compile`d (`engine.decode.step`;
        a CUDA graph on CUDA): True, False, "auto" (on for CUDA, off for CPU, where compiling
        takes minutes), or "static" (the same static-shape step, run eagerly: for tests).
    interventions: the running session's interventions (`engine.interventions.InterventionPlan`), set
        by the session around each of its forward calls; None (the default) costs each layer one check.
    """

    dsa_force_dense: bool = False
    dsa_dense_layers: frozenset[int] = field(default_factory=frozenset)
    mxfp8_activations: bool = False
    kda_chunk_size: int = 64
    kda_recurrent_max_tokens: int = 8
    expert_cache_mib: int = 256
    kernels: str = "auto"
    compile: bool | str = "auto"
    interventions: "InterventionPlan | None" = None

    def reads_dense(self, layer: int) -> bool:
        """Whether DSA layer `layer` reads every past key (forced dense) rather than its top-k."""
        return self.dsa_force_dense or layer in self.dsa_dense_layers
