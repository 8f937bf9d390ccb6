"""Tensor-parallel building blocks the layers use (their collectives go through `comm`).

- `VocabParallelEmbedding`: `embed_tokens` with this rank's rows of the vocabulary; ids owned by
  other ranks embed to zero and one all-reduce fills them in (each id has exactly one owner, so
  the sum is exact).

The other splits need no new module: a column-parallel projection is an `nn.Linear` built with
this rank's output width, a row-parallel one an `nn.Linear` with this rank's input width whose
output the layer all-reduces in its forward (see `engine.weights.shard.SHARD_DIM`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel import comm
from engine.parallel.mesh import ParallelContext


class VocabParallelEmbedding(nn.Embedding):
    """`weight` [vocab / world, hidden]: rows [rank V/w, (rank+1) V/w) of the embedding table."""

    def __init__(self, vocab_size: int, hidden: int, parallel: ParallelContext) -> None:
        start, stop = parallel.local_range(vocab_size)
        super().__init__(stop - start, hidden)
        self.parallel = parallel
        self.start, self.stop = start, stop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> [B, T, hidden]."""
        if self.parallel.world == 1:
            return super().forward(ids)
        outside = (ids < self.start) | (ids >= self.stop)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return comm.all_reduce(out, self.parallel, "embed")
