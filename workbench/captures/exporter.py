"""A recorded trace written out as the responses vLLM or SGLang would have returned for the same conversation.

The round-trip proof of the importer (tests/workbench/test_captures.py): record a session with our
engine, export its routes and selections here in each engine's format, import them, and compare the
reductions. It needs every route and selection of the session (record with policy "all"), and one
response per generated answer: response i holds the tokens up to the end of answer i.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.config import ModelConfig
from engine.errors import InputError
from workbench.captures.arrays import encode_flat, encode_npy
from workbench.captures.records import family_layers
from workbench.trace import open_trace


def _full(trace, table: str, column: str, layers: tuple[int, ...], n: int, width: int, fill: int,
          hidden: int) -> np.ndarray:
    """[n, hidden, width] array of one list column, every position of every layer present (else an error)."""
    out = np.full((n, hidden, width), fill, np.int64)
    df = trace.df(table)
    for layer in layers:
        rows = df[df["layer"] == layer]
        if sorted(rows["position"]) != list(range(n)):
            raise InputError(f"{table} of layer {layer} does not hold every position: record with policy \"all\"")
        for pos, values in zip(rows["position"], rows[column]):
            out[pos, layer, : len(values)] = values
    return out


def export_responses(trace_path: str | Path, config: ModelConfig, engine: str, *, dtype: str = "int32",
                     layer_axis: str = "hidden") -> list[dict]:
    """One response per generated answer of the trace, as `engine` ("vllm" / "sglang") returns it.

    Args:
        dtype: the wire dtype of the arrays ("int32", "uint16", "uint8").
        layer_axis: "hidden" (every layer, as both engines size it) or "family" (only MoE / DSA layers).
    """
    trace = open_trace(trace_path)
    ids = trace.tokens().sort_values("position")["token_id"].to_numpy(np.int64)
    forwarded = len(ids) - 1
    hidden = config.num_hidden_layers
    routes = _full(trace, "moe_routes", "experts", family_layers(config, "moe"), forwarded,
                   config.num_experts_per_token, 0, hidden)
    selections = None
    if config.dsa is not None and "dsa_topk" in trace.session.get("parts", {}):
        selections = _full(trace, "dsa_topk", "selected", family_layers(config, "dsa"), forwarded, config.dsa.topk,
                           -1, hidden)
    if layer_axis == "family":
        routes = routes[:, list(family_layers(config, "moe"))]
        selections = None if selections is None else selections[:, list(family_layers(config, "dsa"))]
    answers = [s for s in trace.session["segments"] if s["kind"] == "generated"]
    out = []
    for i, answer in enumerate(answers):
        start, end = int(answer["start"]), int(answer["end"])
        prompt, output = ids[:start].tolist(), ids[start:end].tolist()
        if engine == "vllm":
            out.append({"id": f"chatcmpl-k3wb-{i}", "object": "chat.completion", "prompt_token_ids": prompt,
                        "prompt_routed_experts": encode_npy(routes[:start], dtype),
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                                     "finish_reason": "length", "token_ids": output,
                                     "routed_experts": encode_npy(routes[start: end - 1], dtype)}]})
        elif engine == "sglang":
            meta = {"id": f"k3wb-{i}", "prompt_tokens": len(prompt), "completion_tokens": len(output),
                    "routed_experts": encode_flat(routes[: end - 1], dtype)}
            if dtype != "int32":
                meta["routed_experts_dtype"] = dtype
            if selections is not None:
                meta["indexer_topk"] = encode_flat(selections[: end - 1])
            out.append({"text": "", "output_ids": output, "input_ids": prompt, "meta_info": meta})
        else:
            raise InputError(f"unknown capture engine {engine!r}; choose vllm or sglang")
    return out
