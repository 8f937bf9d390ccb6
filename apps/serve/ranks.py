"""`workbench serve` under torchrun: rank 0 serves HTTP, every rank runs the same steps.

Rank 0's worker announces each request it is about to run (the request body as the client sent
it, already checked, its id and its owner: whose conversations it may continue) with `RankChannel.announce`; the other ranks wait in `follow`,
check the same body and run the same job through their own `EngineWorker`, whose every forward
enters the same collectives. Every rank renders, continues a cached conversation and samples the
same way (the logits are all-gathered, the seeds equal), so they stay in step on their own; the one
decision only rank 0 can make, that a client went away, is shared per generated token
(`RankChannel.keep_going`). While no request arrives rank 0 announces "idle" every `IDLE_SECONDS`,
so a waiting collective never reaches the process group's timeout; "stop" ends the followers.
Messages are JSON (never pickle: the body is what a client sent), at most `MAX_MESSAGE_BYTES`.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from engine.parallel import ParallelContext
from engine.parallel.comm import broadcast_bytes, broadcast_flag

IDLE_SECONDS = 5.0
MAX_MESSAGE_BYTES = 1 << 30


class RankChannel:
    """Rank 0 -> every rank: the requests to run, idle beats, stop; and the per-token go-ahead."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx

    @property
    def active(self) -> bool:
        return self.ctx.communicates

    def announce(self, kind: str, **fields: Any) -> None:
        """Rank 0: send one message ("job" with `body` and `request_id`, "idle", "stop")."""
        data = json.dumps({"kind": kind, **fields}, ensure_ascii=False).encode("utf-8")
        broadcast_bytes(data, self.ctx, MAX_MESSAGE_BYTES)

    def receive(self) -> dict[str, Any]:
        """Other ranks: the next message rank 0 announced."""
        return json.loads(broadcast_bytes(None, self.ctx, MAX_MESSAGE_BYTES).decode("utf-8"))

    def keep_going(self, leader_says: bool) -> bool:
        """Every rank, once per generated token: rank 0's verdict on whether the generation goes on."""
        return broadcast_flag(leader_says, self.ctx)


def follow(channel: RankChannel, run_body: Callable[[Any, str, str], None]) -> None:
    """Other ranks: run every job rank 0 announces (`run_body(body, request_id, owner)`) until "stop"."""
    while True:
        message = channel.receive()
        kind = message.get("kind")
        if kind == "stop":
            return
        if kind == "job":
            run_body(message["body"], message["request_id"], str(message.get("owner", "")))
