"""Tensor + expert parallelism on torch.distributed (one node of 8 GPUs, or several nodes).

- `mesh`: `ParallelContext` (rank, world, group) and `init_distributed` / `distributed()` for
  entry points launched by torchrun.
- `comm`: the only module that calls collectives; no-ops at world 1.
- `tp`: the vocabulary-parallel embedding and local-size helpers the layers use.
- `ep`: expert placement and dispatch index maths (pure functions).
- `failure`: the watchdog that makes every rank exit when one fails.
"""

from engine.parallel.mesh import ParallelContext, distributed, init_distributed

__all__ = ["ParallelContext", "distributed", "init_distributed"]
