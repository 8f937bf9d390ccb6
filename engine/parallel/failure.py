"""Fail fast across ranks: when one rank raises or dies, every rank exits promptly, naming it.

A collective whose peer is gone can block until the process-group timeout (NCCL) or fail with an
error that blames nobody (gloo). The watchdog keeps the job bounded and readable instead. It uses
the rendezvous store torch.distributed already has (the torchrun agent's, or rank 0's):

- every `poll_s` each rank bumps its heartbeat counter `hb/R` and looks for a `failed` record;
- a rank that raises calls `report(exc)`: the first report becomes `failed` = "rank R failed: ...",
  then it waits (at most `grace_s`) until the others have seen it, so its message reaches them
  even when it hosts the store. When a peer has gone quiet the error is most likely the echo of
  that peer's death (gloo: "connection closed by peer"), so it first lets the watchdog name it;
- a watchdog that finds `failed`, a silent peer (no heartbeat for `heartbeat_timeout_s`), or an
  unreachable store prints one line naming the rank at fault and ends its process (exit 1): the
  main thread may be blocked inside a collective that cannot be interrupted.
- a rank that finishes cleanly marks `done/R` so its silence is not mistaken for death.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch.distributed as dist


class Watchdog:
    """Heartbeats and failure records of one rank in a shared `torch.distributed.Store`."""

    def __init__(self, store: dist.Store, rank: int, world: int, heartbeat_timeout_s: float = 30.0,
                 poll_s: float = 0.25, grace_s: float = 5.0) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.heartbeat_timeout_s, self.poll_s, self.grace_s = heartbeat_timeout_s, poll_s, grace_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # exists before the process group does, so peers can read it once the group is up
        self.store.add(f"hb/{rank}", 1)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"rank{self.rank}-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Clean stop: mark this rank done so peers stop expecting heartbeats."""
        self._halt()
        try:
            self.store.set(f"done/{self.rank}", "1")
        except Exception:  # the store host already left: nothing to tell
            pass

    def report(self, exc: BaseException) -> None:
        """Record this rank's failure for all ranks (the first report wins), then wait for them."""
        try:
            if self._thread is not None and self._silent_peers(4 * self.poll_s):
                # a peer went quiet: this error is most likely the echo of its death (a closed
                # connection); the watchdog names it once its heartbeat times out
                self._stop.wait(self.heartbeat_timeout_s + 4 * self.poll_s)
        except Exception:  # the store is gone too: report what we know
            pass
        self._halt()
        message = f"rank {self.rank} failed: {type(exc).__name__}: {exc}"
        print(f"error: {message}", file=sys.stderr, flush=True)
        try:
            if self.store.add("failures", 1) == 1:
                self.store.set("failed", message)
            deadline = time.monotonic() + self.grace_s
            while self.store.add("seen", 0) < self.world - 1 and time.monotonic() < deadline:
                time.sleep(self.poll_s)
        except Exception:  # the store is gone: peers learn from their own watchdogs
            pass

    def _silent_peers(self, window_s: float) -> list[int]:
        """Peers whose heartbeat did not move during `window_s` (and that did not finish cleanly)."""
        peers = [r for r in range(self.world) if r != self.rank]
        before = self._heartbeats(peers)
        time.sleep(window_s)
        after = self._heartbeats(peers)
        return [r for r, b, a in zip(peers, before, after) if a == b and not self.store.check([f"done/{r}"])]

    def _heartbeats(self, ranks: list[int]) -> list[bytes]:
        return [self.store.get(f"hb/{r}") for r in ranks]

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        peers = [r for r in range(self.world) if r != self.rank]
        last_count = {r: b"" for r in peers}
        last_change = {r: time.monotonic() for r in peers}
        while not self._stop.wait(self.poll_s):
            try:
                self.store.add(f"hb/{self.rank}", 1)
                if self.store.check(["failed"]):
                    self._exit(self.store.get("failed").decode())
                counts = self._heartbeats(peers)
                now = time.monotonic()
                for r, count in zip(peers, counts):
                    if count != last_count[r]:
                        last_count[r], last_change[r] = count, now
                    elif now - last_change[r] > self.heartbeat_timeout_s and not self.store.check([f"done/{r}"]):
                        message = f"rank {r} stopped responding (no heartbeat for {self.heartbeat_timeout_s:.0f} s)"
                        if self.store.add("failures", 1) == 1:
                            self.store.set("failed", message)
                        self._exit(message)
            except Exception as exc:  # the store's host (rank 0 or the torchrun agent) is gone
                if self._stop.is_set():
                    return
                self._exit(f"lost the rendezvous store ({type(exc).__name__}: {exc}); rank 0 or the launcher died")

    def _exit(self, message: str) -> None:
        print(f"error: rank {self.rank} stopping: {message}", file=sys.stderr, flush=True)
        try:
            self.store.add("seen", 1)
        except Exception:
            pass
        os._exit(1)
