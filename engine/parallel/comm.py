"""The one place collectives are called from (forward code calls these; no hooks add any).

Every function takes the `ParallelContext` and is the identity (or a no-op) when the context does
not communicate (world 1, or a layout-only context), so the single-process path pays one attribute
check. When the context carries `stats`, each call records the bytes this rank handed to it,
under a tag naming the call site (`attn.o_proj`, `moe.routed`, ...).

- `all_reduce(x, ctx, tag)`: sum over ranks (row-parallel outputs, expert partial sums).
- `all_gather(x, ctx, dim, tag)`: concatenate shards (vocabulary-parallel logits).
- `assert_same(x, ctx, what)`: debug invariant: every rank holds rank 0's value of `x`.
- `gather_strings(text, ctx)`: one short string per rank (config fingerprints at start).
- `broadcast_bytes(data, ctx, limit)`: rank 0's bytes on every rank (the requests a server's rank 0
  receives, which every rank then runs); `broadcast_flag(flag, ctx)`: rank 0's yes/no.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.parallel.mesh import ParallelContext


def _record(ctx: ParallelContext, op: str, tag: str, x: torch.Tensor) -> None:
    if ctx.stats is not None:
        ctx.stats.record(op, tag, x.numel() * x.element_size())


def all_reduce(x: torch.Tensor, ctx: ParallelContext, tag: str = "") -> torch.Tensor:
    """Sum of `x` over ranks (in x's dtype); `x` itself is overwritten and returned."""
    if not ctx.communicates:
        return x
    _record(ctx, "all_reduce", tag, x)
    dist.all_reduce(x, group=ctx.group)
    return x


def all_gather(x: torch.Tensor, ctx: ParallelContext, dim: int = -1, tag: str = "") -> torch.Tensor:
    """Concatenation along `dim` of every rank's `x` (equal shapes), in rank order."""
    if not ctx.communicates:
        return x
    _record(ctx, "all_gather", tag, x)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(ctx.world)]
    dist.all_gather(parts, x, group=ctx.group)
    return torch.cat(parts, dim=dim)


def assert_same(x: torch.Tensor, ctx: ParallelContext, what: str) -> None:
    """Raise on every rank when any rank's `x` differs from rank 0's (a broadcast + one flag reduce)."""
    if not ctx.communicates:
        return
    reference = x.clone()
    dist.broadcast(reference, src=0, group=ctx.group)
    differs = torch.tensor([0 if torch.equal(reference, x) else 1], device=x.device)
    dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=ctx.group)
    if differs.item():
        raise RuntimeError(f"cross-rank invariant broken: {what} differs between rank 0 and another rank")


def gather_strings(text: str, ctx: ParallelContext, width: int = 64) -> list[str]:
    """Every rank's `text` (ASCII, at most `width` bytes), in rank order."""
    if not ctx.communicates:
        return [text]
    raw = text.encode("ascii")[:width].ljust(width, b"\0")
    local = torch.tensor(list(raw), dtype=torch.uint8, device=ctx.device)
    parts = [torch.empty_like(local) for _ in range(ctx.world)]
    dist.all_gather(parts, local, group=ctx.group)
    return [bytes(p.tolist()).rstrip(b"\0").decode("ascii") for p in parts]


def broadcast_bytes(data: bytes | None, ctx: ParallelContext, limit: int) -> bytes:
    """Rank 0's `data` on every rank (other ranks pass None); the length is checked against `limit`
    before any rank allocates for it."""
    if not ctx.communicates:
        if data is None:
            raise ValueError("broadcast_bytes needs the data on rank 0")
        return data
    size = torch.tensor([len(data) if ctx.rank == 0 and data is not None else 0], dtype=torch.int64, device=ctx.device)
    dist.broadcast(size, src=0, group=ctx.group)
    n = int(size.item())
    if not 0 <= n <= limit:
        raise RuntimeError(f"rank 0 broadcast {n} bytes, more than the {limit} allowed")
    if ctx.rank == 0:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(ctx.device) if n else \
            torch.empty(0, dtype=torch.uint8, device=ctx.device)
    else:
        buffer = torch.empty(n, dtype=torch.uint8, device=ctx.device)
    if n:
        dist.broadcast(buffer, src=0, group=ctx.group)
    return data if ctx.rank == 0 else bytes(buffer.cpu().numpy().tobytes())


def broadcast_flag(flag: bool, ctx: ParallelContext) -> bool:
    """Rank 0's `flag` on every rank (a decision only rank 0 can make, such as a client that left)."""
    if not ctx.communicates:
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=ctx.device)
    dist.broadcast(value, src=0, group=ctx.group)
    return bool(value.item())
