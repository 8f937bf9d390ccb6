"""The parallel layout: which rank this process is, of how many, and the group it talks through.

- `ParallelContext`: a frozen object handed to the model at construction. Tensor parallelism
  (KDA and MLA heads, the dense MLP, shared experts, vocabulary) and expert parallelism (routed
  experts, contiguous ranges) both span the whole world: one node of 8 GPUs, or several nodes.
  At world 1 no process group exists and every collective is a no-op.
- `ParallelContext.layout(rank, world)`: the same shapes without a process group, for sharded
  loading tests and the planner.
- `shard_range(size, rank, world)`: the even contiguous split every layout decision uses (the
  layers' local sizes and `engine.weights.shard`'s checkpoint slices).
- `CommStats`: an optional per-rank byte counter the collectives report to (benchmarks).
- `check_divisible(config, world)`: every split the layout makes, checked once, naming the field.
- `init_distributed()`: builds the context from torchrun's environment (RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR, MASTER_PORT); NCCL on GPUs, gloo on CPUs; starts the failure watchdog.
- `distributed()`: the context manager entry points use: init, report this rank's failure to all
  others, shut down in order.

Environment variables are read here and nowhere deeper: layers only see the context.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
# Imported before any process group exists, on purpose: its functions take `group=group.WORLD` as
# a default argument, bound when the module is first imported. Imported later (torch._dynamo pulls
# it in on first use), they would hold the default group alive after destroy_process_group, and
# gloo's threads would then be torn down during interpreter shutdown, which aborts now and then
# ("terminate called without an active exception").
import torch.distributed.nn  # noqa: F401

from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.parallel.failure import Watchdog


def shard_range(size: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of rank `rank`'s even share of `size` rows/columns (heads, experts, vocabulary)."""
    share = size // world
    return rank * share, (rank + 1) * share


@dataclass
class CommStats:
    """Bytes each rank handed to collectives, by op and tag (read by benchmarks/bench_parallel.py)."""

    calls: dict[tuple[str, str], int] = field(default_factory=dict)
    nbytes: dict[tuple[str, str], int] = field(default_factory=dict)

    def record(self, op: str, tag: str, nbytes: int) -> None:
        key = (op, tag)
        self.calls[key] = self.calls.get(key, 0) + 1
        self.nbytes[key] = self.nbytes.get(key, 0) + nbytes


@dataclass(frozen=True)
class ParallelContext:
    """Who this process is in the layout.

    Attributes:
        rank: this process's rank (0 at world 1).
        world: number of ranks; TP degree = EP degree = world.
        group: the torch.distributed process group; None at world 1 and in layout-only contexts.
        device: where this rank's weights live (`cuda:LOCAL_RANK` with NCCL, else CPU).
        debug_checks: check cross-rank invariants in forward (DSA top-k and expert ids equal on
            every rank); costs a broadcast per check.
        stats: optional byte counter every collective reports to.
        watchdog: the failure watchdog of a launched job (None otherwise).
    """

    rank: int = 0
    world: int = 1
    group: Any = field(default=None, compare=False)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    debug_checks: bool = False
    stats: CommStats | None = field(default=None, compare=False)
    watchdog: Watchdog | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ConfigError(f"rank {self.rank} outside a world of {self.world}")

    @classmethod
    def layout(cls, rank: int, world: int) -> "ParallelContext":
        """Shapes and slices of rank `rank` of `world`, without a process group (no collectives)."""
        return cls(rank=rank, world=world)

    @property
    def is_leader(self) -> bool:
        """Rank 0 writes outputs."""
        return self.rank == 0

    @property
    def communicates(self) -> bool:
        return self.world > 1 and self.group is not None

    def split(self, n: int) -> int:
        """This rank's share of `n` (heads, rows, experts): n / world."""
        return n // self.world

    def local_range(self, n: int) -> tuple[int, int]:
        """[start, stop) of this rank's contiguous share of `n` items."""
        return shard_range(n, self.rank, self.world)


# the single-process layout: the default of every layer, never communicates
SINGLE = ParallelContext()


def check_divisible(config: ModelConfig, world: int) -> None:
    """Raise ConfigError unless every tensor-/expert-parallel split of `config` divides by `world`."""
    c = config
    splits = {"num_attention_heads": c.num_attention_heads, "linear_attn_config.num_heads": c.kda_num_heads,
              "vocab_size": c.vocab_size}
    if c.first_k_dense_replace:
        splits["intermediate_size"] = c.intermediate_size
    if c.num_experts:
        splits["num_experts"] = c.num_experts
        if c.num_shared_experts:
            splits["moe_intermediate_size x num_shared_experts"] = c.shared_intermediate_size
        if c.routed_expert_hidden_size is not None:
            splits["routed_expert_hidden_size"] = c.routed_expert_hidden_size
    bad = [f"{name}={n}" for name, n in splits.items() if n % world]
    if bad:
        raise ConfigError(f"cannot split the model over {world} ranks: {', '.join(bad)} not divisible by {world} "
                          f"(attention heads, vocabulary, MLP widths and experts are split evenly across ranks)")


def init_distributed(*, backend: str | None = None, timeout_s: float = 600.0, heartbeat_timeout_s: float = 30.0,
                     debug_checks: bool = False) -> ParallelContext:
    """The context of a process launched by torchrun (or any launcher setting its variables).

    Args:
        backend: `nccl` or `gloo`; default NCCL when CUDA is available, else gloo.
        timeout_s: limit of any single collective (the process group timeout).
        heartbeat_timeout_s: a rank whose watchdog stays silent this long is declared dead.
        debug_checks: see `ParallelContext.debug_checks`.

    Returns:
        a world-1 context (no process group) when WORLD_SIZE is unset or 1.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return ParallelContext(debug_checks=debug_checks)
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    timeout = timedelta(seconds=timeout_s)
    # the same rendezvous init_process_group("env://") does; keeping the store lets the watchdog
    # share it (under torchrun the agent hosts it, so it outlives any one worker)
    store, rank, world = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    watchdog = Watchdog(dist.PrefixStore(f"k3wb/{attempt}/watch/", store), rank, world, heartbeat_timeout_s)
    dist.init_process_group(backend, store=dist.PrefixStore(f"k3wb/{attempt}/pg/", store), rank=rank,
                            world_size=world, timeout=timeout)
    watchdog.start()
    return ParallelContext(rank=rank, world=world, group=dist.group.WORLD, device=device,
                           debug_checks=debug_checks, watchdog=watchdog)


def shutdown(ctx: ParallelContext) -> None:
    """Wait for every rank, stop the watchdogs, then tear down the process group."""
    if not (ctx.communicates and dist.is_initialized()):
        return
    # the watchdogs run until every rank is done, so a late failure is still caught; the second
    # barrier keeps the store's host alive until no watchdog polls it any more
    dist.barrier(group=ctx.group)
    if ctx.watchdog is not None:
        ctx.watchdog.stop()
    dist.barrier(group=ctx.group)
    dist.destroy_process_group()
    # drop the context's reference too (the model's layers share this context), so the group's
    # gloo threads are joined here and not during interpreter teardown, where they abort now and
    # then; the context no longer `communicates` (it could not: the group is destroyed)
    object.__setattr__(ctx, "group", None)


@contextmanager
def distributed(**options: Any) -> Iterator[ParallelContext]:
    """`with distributed() as ctx:` around an entry point's work (world 1: a plain context).

    A failure on this rank is recorded for every other rank (their watchdogs exit naming this
    rank) before it propagates; keyword arguments go to `init_distributed`.
    """
    ctx = init_distributed(**options)
    try:
        yield ctx
    except (Exception, KeyboardInterrupt) as exc:
        if ctx.watchdog is not None:
            ctx.watchdog.report(exc)
        raise
    shutdown(ctx)
