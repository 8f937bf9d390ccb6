"""`workbench.record(session, ...)`: attach recorders to a session's probe points, write a trace.

    with workbench.record(session, trace="traces/run1", policy="default") as rec:
        session.append(document, name="report")
        for tok in session.generate(64):
            ...

Inside the block every enabled probe point of the model has a sink; leaving the block (normally or
by an exception) detaches all of them and closes the trace ("complete" or "failed"), so recording
costs nothing afterwards and nothing already recorded is lost. The trace is flushed at least every
`policy.flush_seconds` while the session runs, and `session.json` carries a live `progress` entry.

Under tensor/expert parallelism every rank attaches the same sinks (layers may gather signals with
collectives, which all ranks must enter); only rank 0 writes, so every signal is recorded once.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from engine.probes import ProbePoint, probe_points
from engine.session import Segment, Session
from workbench.record import reduce
from workbench.record.policy import RecordPolicy, load_policy
from workbench.trace import TraceWriter

MODALITIES = ("text", "image")
FAMILIES = {"dsa": ("dsa.topk", "dsa.dense_mass"), "kda": ("kda.state",), "moe": ("moe.route",)}


class Recorder:
    """Turns probe payloads and session events into trace rows (one per session, per trace)."""

    def __init__(self, session: Session, writer: TraceWriter | None, policy: RecordPolicy, families: set[str]) -> None:
        self.session = session
        self.model = session.model
        self.config = session.config
        self.writer = writer
        self.policy = policy
        self.families = families
        self.rank = int(getattr(getattr(self.model, "parallel", None), "rank", 0))
        self.ep_world = int(getattr(getattr(self.model, "parallel", None), "world", 1))
        self._points: list[ProbePoint] = []
        self._segment_of = torch.zeros(0, dtype=torch.long)
        self._segments_seen = 0
        self._last_flush = time.monotonic()
        self._progress: dict = {"phase": "idle", "done": 0, "total": 0, "tokens_per_s": None, "eta_s": None}
        self._generated = 0
        self.rows_written = 0

    # ---- wiring ----------------------------------------------------------------------------------
    def attach(self) -> None:
        wanted = {name for fam in self.families for name in FAMILIES[fam]}
        for point in probe_points(self.model):
            if point.name not in wanted:
                continue
            if point.sink is not None:
                raise RuntimeError(f"{point} is already being recorded (nested record() on one model?)")
            point.options = self._options(point)
            point.sink = self._on_probe
            self._points.append(point)
        self.session.observers.append(self._on_event)
        for seg in self.session.segments:  # context appended before recording started (already in session.json)
            self._on_segment(seg, announce=False)

    def detach(self) -> None:
        for point in self._points:
            point.sink = None
            point.options = {}
        self._points.clear()
        if self._on_event in self.session.observers:
            self.session.observers.remove(self._on_event)

    def _options(self, point: ProbePoint) -> dict:
        p = self.policy
        if point.name == "kda.state":
            return {"extras": p.kda_extras}
        if point.name == "dsa.dense_mass":
            return {"select": self._dense_mass_queries}
        if point.name == "dsa.topk":
            return {"scores": p.dsa_scores}
        return {}

    # ---- helpers -------------------------------------------------------------------------------------
    @property
    def _ctx(self):
        return self.model.probe_context

    def _tags(self, layer: int) -> dict:
        return {"layer": layer, "step": self._ctx.step, "rank": self.rank}

    def _segments_for(self, positions: torch.Tensor) -> torch.Tensor:
        n = int(positions.max()) + 1 if positions.numel() else 0
        if n > len(self._segment_of) or self._segments_seen != len(self.session.segments):
            self._rebuild_segment_map(max(n, len(self.session.tokens)))
        return self._segment_of.to(positions.device)

    def _rebuild_segment_map(self, n: int) -> None:
        seg = torch.zeros(n, dtype=torch.long)
        for s in self.session.segments:
            seg[s.start: min(s.end, n)] = s.id
        last = self.session.segments[-1] if self.session.segments else None
        if last is not None and last.kind == "generated":
            seg[last.start:] = last.id  # the answer grows past its recorded end while decoding
        self._segment_of = seg
        self._segments_seen = len(self.session.segments)

    def _marked(self, positions: torch.Tensor) -> torch.Tensor:
        p = self.policy
        keep = torch.zeros_like(positions, dtype=torch.bool)
        if p.mark_positions:
            keep |= torch.isin(positions, torch.tensor(p.mark_positions, device=positions.device))
        if p.mark_segments:
            ids = [s.id for s in self.session.segments if s.name in p.mark_segments]
            if ids:
                seg = self._segments_for(positions)[positions]
                keep |= torch.isin(seg, torch.tensor(ids, device=positions.device))
        return keep

    def _strided(self, positions: torch.Tensor, stride: int) -> torch.Tensor:
        if stride <= 0:
            return torch.zeros_like(positions, dtype=torch.bool)
        return (positions + 1) % stride == 0

    def _dense_mass_queries(self, positions: torch.Tensor) -> torch.Tensor:
        """Which queries of this forward call get a dense-attention mass measurement."""
        p = self.policy
        if self._ctx.phase == "decode":
            every = p.dense_mass_decode_every
            return torch.full_like(positions, every > 0 and self._ctx.step % every == 0, dtype=torch.bool)
        return self._strided(positions, p.dense_mass_stride) | self._marked(positions)

    def _append(self, table: str, cols: dict | None, layer: int | None) -> None:
        if self.writer is None or cols is None:
            return
        n = len(next(iter(cols.values()))) if cols else 0
        if n == 0:
            return
        if layer is not None:
            cols = {**self._tags(layer), **cols}
        self.rows_written += self.writer.append(table, **cols)

    # ---- probe payloads -----------------------------------------------------------------------------
    def _on_probe(self, point: ProbePoint, payload: dict) -> None:
        if self.writer is None:
            return  # other ranks run the same collectives but do not write
        if point.name == "dsa.topk":
            self._dsa(point.layer, payload)
        elif point.name == "dsa.dense_mass":
            pos, mass = payload["positions"], payload["mass"][0]
            self._append("dsa_dense_mass", {"position": reduce._np(pos).astype(np.int32),
                                            "mass": reduce._np(mass.float()).astype(np.float32)}, point.layer)
        elif point.name == "kda.state":
            self._kda(point.layer, payload)
        elif point.name == "moe.route":
            self._moe(point.layer, payload)

    def _dsa(self, layer: int, payload: dict) -> None:
        p = self.policy
        pos, idx = payload["positions"], payload["indices"][0]  # sessions run one sequence per trace
        scores = payload["scores"][0] if p.dsa_scores else None
        self._append("dsa_key_counts", reduce.dsa_key_counts(idx, p.dsa_bin_tokens), layer)
        self._append("dsa_distance_hist", reduce.dsa_distance_hist(pos, idx), layer)
        self._append("dsa_segment_totals", reduce.dsa_segment_totals(idx, self._segments_for(pos)), layer)
        self._append("dsa_sink", reduce.dsa_sink(pos, idx, p.sink_tokens), layer)
        if self._ctx.phase == "decode":
            keep = torch.full_like(pos, p.dsa_decode_lists, dtype=torch.bool)
        else:
            keep = self._strided(pos, p.dsa_prefill_stride)
        keep |= self._marked(pos)
        self._append("dsa_topk", reduce.dsa_lists(pos, idx, scores, keep), layer)

    def _kda(self, layer: int, payload: dict) -> None:
        pos = payload["positions"]
        stats = {k: v[0] for k, v in payload.items() if k != "positions"}
        if self._ctx.phase == "decode":
            keep = torch.ones_like(pos, dtype=torch.bool)
        else:
            keep = self._strided(pos, self.policy.kda_every_tokens) | self._marked(pos)
            keep[-1] = True  # the state at the end of every forward call
        self._append("kda_norms", reduce.kda_rows(pos, stats, keep), layer)

    def _moe(self, layer: int, payload: dict) -> None:
        p = self.policy
        pos, experts, weights = payload["positions"], payload["experts"][0], payload["weights"][0]
        entropy = payload.get("entropy")
        entropy = entropy[0] if entropy is not None else None
        seg = self._segments_for(pos)[pos]
        modality = torch.zeros_like(seg)  # image tokens arrive with the vision tower
        self._append("moe_counts", reduce.moe_counts(experts, seg, modality, self.config.num_experts, MODALITIES),
                     layer)
        self._append("moe_rank_load", reduce.moe_rank_load(experts, self.config.num_experts, self.ep_world), layer)
        if self._ctx.phase == "decode":
            keep = torch.full_like(pos, p.moe_decode_routes, dtype=torch.bool)
        elif p.moe_window_every > 0:
            keep = (pos % p.moe_window_every) < p.moe_window_tokens
        else:
            keep = torch.zeros_like(pos, dtype=torch.bool)
        keep |= self._marked(pos)
        self._append("moe_routes", reduce.moe_routes(pos, experts, weights, entropy, keep), layer)

    # ---- session events --------------------------------------------------------------------------------
    def _on_event(self, event: str, payload: dict) -> None:
        if self.writer is None:
            return
        if event == "segment":
            self._on_segment(payload["segment"])
        elif event == "token":
            tok = payload["token"]
            self._generated += 1
            self._token_rows([tok.position], [tok.id], self.session.segments[-1].id)
            self._progress = {**self._progress, "phase": "decode", "generated": self._generated}
        elif event == "prefill_progress":
            done, total, elapsed = payload["done"], payload["total"], payload["elapsed"]
            rate = done / elapsed if elapsed > 0 else None
            self._progress = {"phase": "prefill" if done < total else "idle", "done": done, "total": total,
                              "tokens_per_s": rate, "eta_s": (total - done) / rate if rate else None}
        elif event == "step":
            if time.monotonic() - self._last_flush >= self.policy.flush_seconds:
                self.flush()

    def _on_segment(self, seg: Segment, announce: bool = True) -> None:
        if self.writer is None:
            return
        if announce:
            self.writer.add_segment(_segment_json(seg))
        if seg.kind != "generated" and seg.end > seg.start:
            self._token_rows(range(seg.start, seg.end), self.session.tokens[seg.start:seg.end], seg.id)

    def _token_rows(self, positions, ids, segment: int) -> None:
        tok = self.session.tokenizer
        ids = list(ids)
        pieces = [tok.piece(i) for i in ids] if tok is not None else [str(i) for i in ids]
        self._append("tokens", {"position": np.asarray(list(positions), np.int32),
                                "token_id": np.asarray(ids, np.int32), "piece": np.asarray(pieces, dtype=object),
                                "segment": np.full(len(ids), segment, np.int32),
                                "modality": np.full(len(ids), "text", dtype=object)}, None)

    def flush(self) -> None:
        if self.writer is None:
            return
        self.writer.flush()
        self.writer.update_session(segments=[_segment_json(s) for s in self.session.segments],
                                   progress=self._progress, timings=_timings(self.session))
        self._last_flush = time.monotonic()


def _segment_json(seg: Segment) -> dict:
    return {"id": seg.id, "kind": seg.kind, "name": seg.name, "start": seg.start, "end": seg.end,
            "modality": seg.modality, **({"role": seg.role} if seg.role else {})}


def _timings(session: Session) -> dict:
    r = session.record.to_json()
    return {k: r[k] for k in ("ttft_s", "tpot_s", "tokens_per_s", "prefill_tokens_per_s", "prompt_tokens",
                              "output_tokens", "peak_memory_bytes")}


def _session_meta(session: Session, policy: RecordPolicy) -> dict:
    model = session.model
    parallel = getattr(model, "parallel", None)
    return {
        "model": {**session.config.summary(), "checkpoint": session.record.model},
        "engine": {"dtype": str(session.dtype).removeprefix("torch."), "device": str(session.device),
                   "prefill_chunk": session.prefill_chunk, "world_size": int(getattr(parallel, "world", 1)),
                   "dsa_force_dense": model.runtime.dsa_force_dense,
                   "mxfp8_activations": model.runtime.mxfp8_activations},
        "policy": policy.to_json(),
        "segments": [_segment_json(s) for s in session.segments],
    }


@contextlib.contextmanager
def record(session: Session, *, trace: str | Path, dsa: bool = True, kda: bool = True, moe: bool = True,
           policy: "str | RecordPolicy | dict | None" = "default", overwrite: bool = False) -> Iterator[Recorder]:
    """Record the session's DSA selections, KDA state norms and expert routes into a trace directory.

    Args:
        session: the running `engine.session.Session`.
        trace: the trace directory (created; an existing trace is replaced only with overwrite=True).
        dsa / kda / moe: which signal families to record.
        policy: "default", "all", a `RecordPolicy`, a dict of fields or a JSON file (see `policy.py`).

    Yields:
        the `Recorder` (its `writer`, `policy`, `rows_written`).
    """
    pol = load_policy(policy)
    families = {name for name, on in (("dsa", dsa), ("kda", kda), ("moe", moe)) if on}
    rank = int(getattr(getattr(session.model, "parallel", None), "rank", 0))
    writer = TraceWriter.create(trace, _session_meta(session, pol), overwrite=overwrite) if rank == 0 else None
    rec = Recorder(session, writer, pol, families)
    status = "failed"
    try:
        rec.attach()
        yield rec
        status = "complete"
    finally:
        rec.detach()
        if writer is not None:
            try:
                rec.flush()
            finally:
                writer.close(status)
