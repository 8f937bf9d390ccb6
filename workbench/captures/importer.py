"""`import_capture`: saved vLLM / SGLang responses -> a trace in our schema, reduced as our recorder reduces.

    summary = import_capture("sglang", "responses.jsonl", "checkpoints/k3.1-pro", "traces/agent-run")

The responses of one file are one conversation: each record's prompt continues the previous record's
tokens (prompt + output), as an agent's turns do. Each record adds a `turn` segment (its new prompt
tokens) and a `generated` segment (its output). Positions are forwarded exactly once in the trace;
a later response's rows for positions an earlier one already covered are not read again.

Reductions are the recorder's own: each chunk of captured rows goes through the family's `to_rows`
(`workbench.signals.dsa` / `moe`) as the emissions a session would have sent, with this import as the
recording context (`workbench.recorders.rows` queues and writes the tables for both): expert counts by segment and
modality, EP rank load, DSA key-bin counts, read distances, per-segment totals and sink hits, and the
raw rows the policy keeps (prompt positions are "prefill", generated ones "decode", as in a session).
What a capture does not hold is absent, and `session.json` says so under `capture.absent` (KDA state,
DSA dense mass, router weights and entropy; indexer top-k when the engine returned none).

Crash safety: the trace is written into a temporary directory beside the target and renamed into
place only when complete (`engine.io.atomic_dir`); a failure removes it, so no half-written trace is left.
An existing target is replaced only with `overwrite` and only when it is a trace this command wrote.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from engine.io import atomic_dir
from engine.io.files import parse_json, read_limited
from engine.config import ModelConfig
from engine.errors import EngineError, InputError
from engine.model_ref import parse_model_ref
from engine.probes import Emission, Marks
from engine.tokenizer import Tokenizer
from workbench.captures.arrays import RowArray
from workbench.captures.records import LayerMap, Record, layer_map, parse_records
from workbench.recorders import rows as pending_rows
from workbench.signals import SignalFamily, dsa, moe
from workbench.recorders.policy import RecordPolicy, load_policy
from workbench.trace import TraceError, TraceWriter
from workbench.trace.bounds import MAX_SESSION_BYTES
from workbench.trace.schema import IMAGES_DIR, SESSION_FILE, TABLES, TOKENS_FILE
from workbench.trace.target import LOCK_FILE

CHUNK_BYTES = 128 << 20  # decoded bytes reduced at a time: memory stays bounded at any capture length
SUMMARIES_DIR = "summaries"  # the dashboard's summaries of a finished trace: stale once the trace is replaced
FAMILIES = {"moe": moe.FAMILY, "dsa": dsa.FAMILY}  # what a capture holds
EP_WORLD = 1  # a capture does not say how the server spread experts over ranks: all load is rank 0's
ABSENT = {
    "kda": "KDA state is not captured by vLLM or SGLang",
    "dsa_dense_mass": "dense attention mass needs the attention scores, which no capture holds",
    "moe_routes.weights": "captures hold expert ids only; router weights are NaN",
    "moe_routes.entropy": "captures hold expert ids only; router entropy is NaN",
}
NO_SELECTIONS = {
    "vllm": "vLLM returns no indexer top-k in a release (vllm-project/vllm PR 49555 is open)",
    "sglang": "the responses hold no meta_info.indexer_topk (launch SGLang with --enable-return-indexer-topk "
              "and ask with return_indexer_topk)",
}


def load_capture_model(spec: str) -> tuple[ModelConfig, Tokenizer | None]:
    """`--model`: a checkpoint directory, a config.json, `builtin:NAME` or `preset:NAME[:VARIANT]`."""
    ref = parse_model_ref(spec)
    config = ref.config()
    return config, Tokenizer.for_model(ref.directory or ref.text, config.vocab_size)


def _written_by_import(name: str) -> bool:
    """Entries of a trace directory an import (its writer) or the dashboard's summaries put there; the
    rest is the user's and is carried into a replacing trace."""
    return name in {SESSION_FILE, TOKENS_FILE, IMAGES_DIR, SUMMARIES_DIR, LOCK_FILE, *TABLES}


def _is_imported_trace(path: Path) -> bool:
    try:
        session = parse_json(read_limited(path / SESSION_FILE, "a trace's session.json", TraceError, MAX_SESSION_BYTES),
                             str(path / SESSION_FILE), TraceError)
        return isinstance(session, dict) and "capture" in session
    except (OSError, ValueError, EngineError):
        return False


class _Import:
    """State of one import: the conversation's positions, segments and the writer."""

    def __init__(self, config: ModelConfig, tokenizer: Tokenizer | None, policy: RecordPolicy,
                 records: list[Record]) -> None:
        self.config, self.tokenizer, self.policy, self.records = config, tokenizer, policy, records
        self.ids = np.zeros(0, np.int64)
        self.segments: list[dict] = []
        self.decode = np.zeros(0, bool)  # positions forwarded in a decode step (generated, not the last)
        self._layout()
        self.segment_of = torch.zeros(len(self.ids), dtype=torch.long)
        for seg in self.segments:
            self.segment_of[seg["start"]: seg["end"]] = seg["id"]
        spans = tuple((s["start"], s["end"]) for s in self.segments if s["name"] in policy.mark_segments)
        self.marks = Marks(tuple(policy.mark_positions), spans)
        self.step = 0
        self.covered = {"moe": 0, "dsa": 0}  # positions below this already have rows
        self.missing = {"moe": 0, "dsa": 0}
        self.maps: dict[str, LayerMap] = {}
        self.ep_world = EP_WORLD
        self.tables = pending_rows.PendingTables()

    def _layout(self) -> None:
        """Check the records form one conversation and lay out its segments."""
        ids: list[np.ndarray] = []
        decode: list[np.ndarray] = []
        done, so_far = 0, np.zeros(0, np.int64)
        for rec in self.records:
            if len(rec.prompt) < done or not np.array_equal(rec.prompt[:done], so_far):
                raise InputError(f"record {rec.number}: its prompt does not continue the tokens of the records "
                                 f"before it (one file is one conversation; import other conversations "
                                 f"into traces of their own)")
            new = rec.prompt[done:]
            name = f"request {rec.number}" + (f" ({rec.request_id})" if rec.request_id else "")
            if len(new):
                self.segments.append({"id": len(self.segments), "kind": "turn", "name": f"{name} prompt",
                                      "start": done, "end": done + len(new), "modality": "text"})
            end = done + len(new) + len(rec.output)
            self.segments.append({"id": len(self.segments), "kind": "generated", "name": f"{name} output",
                                  "start": done + len(new), "end": end, "modality": "text"})
            ids += [new, rec.output]
            flags = np.zeros(len(new) + len(rec.output), bool)
            flags[len(new): len(new) + max(len(rec.output) - 1, 0)] = True
            decode.append(flags)
            so_far = np.concatenate([so_far, new, rec.output])
            done = end
        self.ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        self.decode = np.concatenate(decode) if decode else np.zeros(0, bool)

    # ---- the recording context the families' `to_rows` write through (`workbench.signals.family`) ----------------
    @property
    def n_segments(self) -> int:
        return len(self.segments) or 1

    def position_maps(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """position -> segment id, and position -> modality index (a capture holds token ids only: text)."""
        seg = self.segment_of[:n].to(device)
        return seg, torch.zeros_like(seg)

    def pend(self, table: str, layer: int | None, rank: int, cols: dict | None, drop_zero: str | None = None) -> None:
        self.tables.pend(table, layer, rank, cols, drop_zero)

    def rows(self, table: str, layer: int, rank: int, keep: np.ndarray | None, steps: torch.Tensor,
             fields: dict[str, torch.Tensor]) -> None:
        self.tables.rows(table, layer, rank, keep, steps, fields)

    def keep_items(self, items: list[Emission], stride: int, *, decode_all: bool, last: bool = False,
                   window: tuple[int, int] | None = None) -> np.ndarray:
        return pending_rows.keep_items(items, stride, self.marks, decode_all=decode_all, last=last, window=window)

    def _emissions(self, pos: np.ndarray, fields: dict[str, torch.Tensor]) -> list[Emission]:
        """The chunk as the emissions a session would have sent: one per run of prompt ("prefill") or
        generated ("decode") positions, all of this import step."""
        decode = self.decode[pos]
        cuts = np.flatnonzero(np.diff(decode.astype(np.int8))) + 1
        items = []
        for lo, hi in zip([0, *cuts], [*cuts, len(pos)]):
            data = {name: t[lo:hi] for name, t in fields.items()}
            items.append(Emission(None, self.step, "decode" if decode[lo] else "prefill", 0, data))
        return items

    def _feed(self, family: SignalFamily, signal: str, layer: int, pos: np.ndarray,
              fields: dict[str, torch.Tensor]) -> None:
        """Hand one layer's rows of a chunk to the family's own reduction, as the recorder would."""
        fields = {"positions": torch.from_numpy(pos), **fields}
        items = self._emissions(pos, fields)
        steps = torch.full((len(pos),), self.step, dtype=torch.long)
        family.to_rows(self, signal, layer, 0, items, steps, fields)

    # ---- arrays -------------------------------------------------------------------------------------------------
    def chunks(self, family: str, array: RowArray, end: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(positions, rows [n, layers, width]) of the array's positions not yet covered, CHUNK_BYTES at a time."""
        start = end - array.rows
        if start < 0:
            raise InputError(f"{array.where}: {array.rows:,} rows but only {end:,} forwarded tokens")
        first = max(start, self.covered[family])
        self.missing[family] += max(start - self.covered[family], 0)
        step = max(1, CHUNK_BYTES // max(array.row_bytes, 1))
        for lo in range(first, end, step):
            hi = min(lo + step, end)
            yield np.arange(lo, hi), array.read(lo - start, hi - start)
        self.covered[family] = max(self.covered[family], end)

    def layers(self, family: str, array: RowArray) -> LayerMap:
        found = layer_map(self.config, family, array.layers)
        known = self.maps.setdefault(family, found)
        if known != found:
            raise InputError(f"{array.where}: its layer axis ({found.axis}) differs from earlier records' "
                             f"({known.axis})")
        return found

    def moe(self, writer: TraceWriter, array: RowArray, end: int) -> None:
        lmap = self.layers("moe", array)
        for pos, rows in self.chunks("moe", array, end):
            self.step += 1
            for entry, layer in zip(lmap.entries, lmap.layers):
                experts = rows[:, entry, :].astype(np.int64)
                bad = np.argwhere((experts < 0) | (experts >= self.config.num_experts))
                if len(bad):
                    r, c = bad[0]
                    raise InputError(f"{array.where}: expert id {experts[r, c]} at position {pos[r]} (layer {layer}) "
                                     f"is outside [0, {self.config.num_experts}) of the model config")
                n, k = experts.shape
                self._feed(moe.FAMILY, "moe.route", layer, pos, {  # captures hold no router weights: NaN
                    "experts": torch.from_numpy(experts), "weights": torch.full((n, k), float("nan"), dtype=torch.float16),
                    "entropy": torch.full((n,), float("nan"))})
            self.tables.drain(writer, FAMILIES)

    def dsa(self, writer: TraceWriter, array: RowArray, end: int) -> None:
        lmap = self.layers("dsa", array)
        for pos, rows in self.chunks("dsa", array, end):
            self.step += 1
            for entry, layer in zip(lmap.entries, lmap.layers):
                idx = rows[:, entry, :].astype(np.int64)
                bad = np.argwhere((idx < -1) | (idx > pos[:, None]))
                if len(bad):
                    r, c = bad[0]
                    raise InputError(f"{array.where}: key position {idx[r, c]} selected by the query at position "
                                     f"{pos[r]} (layer {layer}) is not in [0, {pos[r]}] (-1 = empty slot)")
                self._feed(dsa.FAMILY, "dsa.topk", layer, pos, {"indices": torch.from_numpy(idx)})
            self.tables.drain(writer, FAMILIES)

    def tokens(self, writer: TraceWriter) -> None:
        n = len(self.ids)
        tok = self.tokenizer
        vocab = tok.vocab_size if tok is not None else 0
        pieces = [tok.piece(int(i)) if int(i) < vocab else str(int(i)) for i in self.ids] if tok is not None else \
            [str(int(i)) for i in self.ids]
        writer.append("tokens", position=np.arange(n, dtype=np.int32), token_id=self.ids.astype(np.int32),
                      piece=np.asarray(pieces, dtype=object), segment=self.segment_of.numpy().astype(np.int32),
                      modality="text", image_id=np.full(n, -1, np.int32), patch_row=np.full(n, -1, np.int16),
                      patch_col=np.full(n, -1, np.int16))


def import_capture(engine: str, responses: str | Path, model: str, out: str | Path, *,
                   policy: "str | RecordPolicy | dict | None" = "default", overwrite: bool = False) -> dict:
    """Write the trace of a saved vLLM / SGLang conversation; returns the `capture` entry of its session.json.

    Args:
        engine: "vllm" or "sglang" (which response format the file holds).
        responses: JSON (one response or a list) or JSON Lines file of saved responses, in conversation order.
        model: the model the server ran: checkpoint directory, config.json, builtin:NAME or preset:NAME.
        out: the trace directory to write (absent, empty, or an imported trace with overwrite=True).
        policy: which raw rows to keep, as for `workbench.record` ("default", "all", a file, ...).
    """
    out, responses = Path(out), Path(responses)
    atomic_dir.recover(out, lambda p: (p / SESSION_FILE).is_file())
    atomic_dir.require_ours(out, overwrite, _is_imported_trace, "a trace written by `workbench import`", TraceError)
    config, tokenizer = load_capture_model(str(model))
    pol = load_policy(policy)
    records = parse_records(engine, responses, config)  # every shape and token id checked before any writing
    state = _Import(config, tokenizer, pol, records)
    have_dsa = any(rec.selections for rec in records)
    absent = dict(ABSENT)
    if not have_dsa:
        absent["dsa"] = NO_SELECTIONS[engine] if config.dsa is not None else "the model has no DSA layers"
    if not any(rec.routes for rec in records):
        absent["moe"] = "the responses hold no routed experts (launch the server with --enable-return-routed-experts)"
    capture = {"engine": engine, "responses": responses.name, "records": len(records),
               "request_ids": [rec.request_id for rec in records], "absent": absent}
    meta = {"model": {**config.summary(), "checkpoint": str(model)}, "engine": {"source": f"{engine} capture"},
            "policy": pol.to_json(), "segments": state.segments, "capture": capture}
    tmp = atomic_dir.temp_path(out)
    if tmp.exists():
        shutil.rmtree(tmp)  # this process's own temporary from an earlier attempt
    writer = TraceWriter.create(tmp, meta)
    threads = torch.get_num_threads()
    # the reductions run on chunks of a few thousand rows, where intra-op threads cost more in
    # hand-offs than they save; the caller's setting is restored below
    torch.set_num_threads(1)
    try:
        state.tokens(writer)
        for rec in records:  # positions are the conversation's: each prompt continues the records before it
            for array, end in rec.routes:
                state.moe(writer, array, end)
            for array, end in rec.selections:
                state.dsa(writer, array, end)
        capture["layer_map"] = {family: lmap.to_json() for family, lmap in state.maps.items()}
        capture["positions_without_rows"] = {f: state.missing[f] + max(len(state.ids) - 1 - state.covered[f], 0)
                                             for f in state.maps}
        writer.update_session(capture=capture)
        writer.close("complete")
        atomic_dir.carry_over(out, tmp, _written_by_import)  # copies, never moves: the user's files survive a crash
        atomic_dir.replace(tmp, out)
    except BaseException:
        try:
            writer.close("failed")
        except Exception:  # the failure being raised matters, not a second one while cleaning up
            pass
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads)
    return capture
