"""Routed experts and indexer top-k in a response, as vLLM and SGLang return them when asked.

A request asks with SGLang's flags `return_routed_experts: true` / `return_indexer_topk: true`
(vLLM keys routed experts on its server flag `--enable-return-routed-experts`; this server has no such
flag, so the request's flag asks for both conventions). The reply then carries both, so a client
written for either engine reads it unchanged:

- vLLM (0.22 names; `return_token_ids: true` adds the ids): `prompt_routed_experts` at the response
  level (rows of the prompt's positions) and `choices[0].routed_experts` (rows of the generated
  positions but the last, which was never fed forward), each a base64 `.npy` of
  `[rows, num_hidden_layers, num_experts_per_token]` int32; `choices[0].indexer_topk` follows the
  shape of vllm-project/vllm PR 49555 (not in a release): a base64 `.npy` of
  `[rows, num_hidden_layers, index_topk]` int32 over every forwarded position.
- SGLang (OpenAI endpoints: PR 17434, and its docs' "Returning Routed Experts" in
  `docs_new/docs/basic_usage/openai_api_completions.ipynb` as of PR 24851): `choices[0].sgl_ext.routed_experts`
  (and, by the same rule, `.indexer_topk`), base64 of the raw row-major int32 bytes of
  `[rows, num_hidden_layers, width]` over positions `[routed_experts_start_len, seqlen - 1)`, where the
  request's `routed_experts_start_len` defaults to 0. This server also names the start it used in
  `sgl_ext.routed_experts_start_len` (a later start than asked when a restored prefix's rows are not held).

Layers without the signal keep zeros (routes) or -1 (selections), as both capturers leave them; a
selected key is a sequence position (-1 an empty slot). Rows end where the tokens fed forward end
(`prompt + output - 1`); they start at 0 unless a cached prefix restored from a request that did not
ask for captures (then they start at the restored length: fewer rows say so, as `workbench import`
reads them). docs/captures.md names where each field was read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.probes import ProbePoint, probe_points
from workbench.captures import encode_flat, encode_npy


@dataclass
class CaptureStore:
    """The rows one conversation captured, positions [start, start + rows): kept with its cached state
    so a request that continues it returns the prefix's rows too."""

    routes: np.ndarray | None = None      # [rows, layers, experts_per_token] int32
    selections: np.ndarray | None = None  # [rows, layers, topk] int32
    start: int = 0

    def rows(self) -> int:
        arrays = [a for a in (self.routes, self.selections) if a is not None]
        return len(arrays[0]) if arrays else 0


class _Rows:
    """One family's emissions of one job: a [positions, layers, width] int32 array grown by doubling from
    the job's first position, and which positions some layer wrote (a missing one: not computed here)."""

    def __init__(self, layers: int, width: int, fill: int) -> None:
        self.layers, self.width, self.fill = layers, width, fill
        self.base: int | None = None
        self.values = np.full((0, layers, width), fill, np.int32)
        self.written = np.zeros(0, bool)

    def _reach(self, last: int) -> None:
        need = last - self.base + 1  # type: ignore[operator]
        if need > len(self.values):
            size = max(need, 2 * len(self.values), 256)
            grown = np.full((size, self.layers, self.width), self.fill, np.int32)
            grown[: len(self.values)] = self.values
            written = np.zeros(size, bool)
            written[: len(self.written)] = self.written
            self.values, self.written = grown, written

    def put(self, layer: int, positions: np.ndarray, values: np.ndarray) -> None:
        if len(positions) == 0:
            return
        if self.base is None:
            self.base = int(positions.min())
        self._reach(int(positions.max()))
        rows = positions - self.base
        self.values[rows, layer, : values.shape[-1]] = values
        self.written[rows] = True

    def array(self, start: int, end: int) -> np.ndarray | None:
        """Rows [start, end) or None when a position is missing (it was not computed in this job)."""
        if end <= start:
            return np.zeros((0, self.layers, self.width), np.int32)
        if self.base is None or start < self.base or end - self.base > len(self.written) \
                or not self.written[start - self.base: end - self.base].all():
            return None
        return self.values[start - self.base: end - self.base].copy()


class JobCapture:
    """Listens to the served model's route and selection points while one job runs (`attach` / `detach`)."""

    def __init__(self, model: Any, routes: bool, selections: bool) -> None:
        config = model.config
        self.points: list[tuple[ProbePoint, _Rows]] = []
        self.routes = _Rows(config.num_hidden_layers, config.num_experts_per_token, 0) if routes else None
        topk = config.dsa.topk if config.dsa is not None else 0
        self.selections = _Rows(config.num_hidden_layers, topk, -1) if selections and topk else None
        for point in probe_points(model):
            rows = self.routes if point.name == "moe.route" else self.selections if point.name == "dsa.topk" else None
            if rows is not None:
                self.points.append((point, rows))

    def _sink(self, rows: _Rows, field_name: str):
        def sink(emission: Any) -> None:
            values = emission.data[field_name][0].detach().cpu().numpy()
            rows.put(emission.point.layer, emission.data["positions"].numpy(), values)
        return sink

    def attach(self) -> None:
        self._sinks = []
        for point, rows in self.points:
            sink = self._sink(rows, "experts" if point.name == "moe.route" else "indices")
            point.attach(sink)
            self._sinks.append((point, sink))

    def detach(self) -> None:
        for point, sink in getattr(self, "_sinks", []):
            point.detach(sink)
        self._sinks = []

    def store(self, previous: CaptureStore | None, cached: int, end: int) -> CaptureStore:
        """The conversation's rows after this job: the restored prefix's (when they reach `cached`) and this job's."""
        start = cached
        keep_prefix = previous is not None and previous.start + previous.rows() == cached and (
            (previous.routes is not None) == (self.routes is not None)
            and (previous.selections is not None) == (self.selections is not None))
        out = CaptureStore(start=cached)
        for name, rows in (("routes", self.routes), ("selections", self.selections)):
            if rows is None:
                continue
            mine = rows.array(cached, end)
            if mine is None:
                return CaptureStore(start=end)  # a position was not computed here: nothing trustworthy to return
            if keep_prefix:
                mine = np.concatenate([getattr(previous, name), mine])
            setattr(out, name, mine)
        if keep_prefix:
            out.start = previous.start  # type: ignore[union-attr]
        return out if out.routes is not None or out.selections is not None else CaptureStore(start=start)


def response_fields(store: CaptureStore, prompt_tokens: int, total: int, *, routes: bool,
                    selections: bool, sglang_start: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """(response-level fields, choice-level fields) of both conventions for rows [store.start, total - 1)
    (SGLang's from `sglang_start`, the request's `routed_experts_start_len`, when that is later)."""
    top: dict[str, Any] = {}
    choice: dict[str, Any] = {}
    ext: dict[str, Any] = {}
    end = total - 1
    first = min(max(sglang_start, store.start), end)
    if routes and store.routes is not None:
        split = max(prompt_tokens - store.start, 0)
        top["prompt_routed_experts"] = encode_npy(store.routes[:split])
        choice["routed_experts"] = encode_npy(store.routes[split: end - store.start])
        ext["routed_experts"] = encode_flat(store.routes[first - store.start: end - store.start])
        ext["routed_experts_start_len"] = first
    if selections and store.selections is not None:
        choice["indexer_topk"] = encode_npy(store.selections[: end - store.start])
        ext["indexer_topk"] = encode_flat(store.selections[first - store.start: end - store.start])
    if ext:
        choice["sgl_ext"] = ext
    return top, choice


__all__ = ["CaptureStore", "JobCapture", "response_fields"]
