"""K3 vs K3.1 on the same input: run a prompt sparse (A) and with some DSA layers forced dense (B).

    result = compare_runs(model, tokenizer, text, dense_layers={3, 7}, trace_a="traces/a", trace_b="traces/b",
                          out="compare/a_vs_b")
    print(result.summary())

Both runs are recorded (`workbench.record`); a forced-dense layer still runs its indexer and records
what it would have read, so the two traces compare layer by layer. During run A the mixer output
(attention / KDA output) of every layer and the logits are kept on the host; during run B each
chunk is compared as it is computed, so only run A's arrays are held (layers x T x hidden floats).
The comparison directory holds `layers.parquet` (layer, position, rel_diff), `kl.parquet`
(position, kl), `reads.parquet` (layer, position, jaccard, only_a, only_b, changed) and
`summary.json`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from engine.io import atomic_dir
from engine.errors import InputError
from engine.session import Session
from workbench.analysis.read_comparison import next_token_kl, read_changes, relative_difference, summarize_reads
from workbench.recorders import record
from workbench.recorders.policy import RecordPolicy, load_policy
from workbench.trace import check_trace_target, open_trace

HOST_BYTES_LIMIT = 8 << 30  # run A's layer outputs and logits kept for the comparison


@dataclass
class Comparison:
    """What `compare_runs` measured. layers: layer, position, rel_diff; kl: position, kl; reads: per
    query of each DSA layer (see `read_changes`); dense_layers: the layers B forced dense."""

    layers: pd.DataFrame
    kl: pd.DataFrame
    reads: pd.DataFrame
    dense_layers: tuple[int, ...]
    dsa_layers: tuple[int, ...]

    def per_layer(self) -> pd.DataFrame:
        """One row per layer: mean / max relative difference of its output, dense (forced in B), dsa."""
        df = self.layers.groupby("layer", as_index=False)["rel_diff"].agg(mean_rel_diff="mean", max_rel_diff="max")
        df["dense_in_b"] = df["layer"].isin(self.dense_layers)
        df["dsa"] = df["layer"].isin(self.dsa_layers)
        return df

    def to_json(self) -> dict[str, Any]:
        kl = self.kl["kl"].to_numpy()
        return {"dense_layers": list(self.dense_layers), "dsa_layers": list(self.dsa_layers),
                "positions": int(len(kl)), "kl_mean": float(kl.mean()) if len(kl) else None,
                "kl_max": float(kl.max()) if len(kl) else None,
                "kl_max_position": int(self.kl["position"].iloc[int(kl.argmax())]) if len(kl) else None,
                "layers": self.per_layer().to_dict(orient="records"),
                "reads": summarize_reads(self.reads).to_dict(orient="records")}

    def summary(self) -> str:
        """A one-screen text summary."""
        j = self.to_json()
        lines = [f"A = sparse (K3.1), B = layers {','.join(map(str, self.dense_layers))} dense (K3); "
                 f"{j['positions']} positions"]
        if j["positions"]:
            lines.append(f"next-token KL(A||B): mean {j['kl_mean']:.3g} nats, max {j['kl_max']:.3g} at position "
                         f"{j['kl_max_position']}")
        lines.append("layer  kind  mean rel diff  max rel diff")
        for r in j["layers"]:
            kind = ("DENSE" if r["dense_in_b"] else "dsa") if r["dsa"] else "kda"
            lines.append(f"{r['layer']:>5}  {kind:<5} {r['mean_rel_diff']:>13.3g} {r['max_rel_diff']:>13.3g}")
        lines.append("DSA reads (queries recorded in both traces)")
        for r in j["reads"]:
            first = f", first at {r['first_changed']}" if r["first_changed"] >= 0 else ""
            lines.append(f"  layer {r['layer']}: {r['changed_share'] * 100:.0f}% of {r['queries']} queries changed, "
                         f"mean Jaccard {r['mean_jaccard']:.2f}{first}")
        return "\n".join(lines)

    def write(self, out: str | Path, overwrite: bool = False) -> Path:
        """Write the Parquet tables and summary.json into the directory `out`, replaced as a whole.

        An existing comparison is replaced only with `overwrite` (files the user added beside it are
        kept); a directory that holds anything else is refused (`check_comparison_target`).
        """
        out = Path(out)
        check_comparison_target(out, overwrite=overwrite)
        with atomic_dir.building(out, "comparison", InputError, is_comparison) as tmp:
            for name, frame in (("layers.parquet", self.layers), ("kl.parquet", self.kl),
                                ("reads.parquet", self.reads)):
                pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), tmp / name)
            # the marker, written last: names the format, so a user's own summary.json is never taken for ours
            (tmp / SUMMARY_FILE).write_text(json.dumps({"format": FORMAT, **self.to_json()}, indent=1),
                                            encoding="utf-8")
            atomic_dir.carry_over(out, tmp, _FILES.__contains__)
            atomic_dir.replace(tmp, out)
        return out


FORMAT, SUMMARY_FILE = "k3-workbench-comparison", "summary.json"
_FILES = ("layers.parquet", "kl.parquet", "reads.parquet", SUMMARY_FILE)


def is_comparison(path: Path) -> bool:
    """Whether `path` is a directory `Comparison.write` wrote (its summary.json names our format)."""
    try:
        with open(Path(path) / SUMMARY_FILE, "rb") as f:
            summary = json.loads(f.read(64 << 20))
    except (OSError, ValueError, RecursionError):
        return False
    if not isinstance(summary, dict):
        return False
    if summary.get("format") == FORMAT:
        return True
    # written before the format was named: all four files and the summary's own keys
    return ("format" not in summary and {"dense_layers", "dsa_layers", "kl_mean", "layers", "reads"} <= set(summary)
            and all((Path(path) / name).is_file() for name in _FILES))


def check_comparison_target(out: str | Path, *, overwrite: bool = False,
                            traces: Collection[str | Path] = ()) -> None:
    """Refuse, before any run, an `out` a comparison cannot be written to (InputError, one line): one of
    the `traces`, inside or around one, a file, a foreign directory, or a comparison without `overwrite`."""
    out = Path(out)
    dst = out.resolve()
    for trace in traces:
        src = Path(trace).resolve()
        if dst == src or src in dst.parents or dst in src.parents:
            raise InputError(f"comparison directory {out} overlaps the trace {trace}; choose another directory")
    atomic_dir.recover(out, is_comparison)
    atomic_dir.require_ours(out, overwrite, is_comparison, "a comparison written by `workbench compare`", InputError)
    if out.is_dir() and any(out.iterdir()):
        atomic_dir.require_replaceable(out, _FILES.__contains__, InputError)


def parse_layers(spec: str, dsa_layers: Collection[int]) -> frozenset[int]:
    """`3,7` or `all` -> DSA layer ids; a layer that is not a DSA layer is an error naming it."""
    spec = spec.strip()
    if spec == "all":
        return frozenset(dsa_layers)
    try:
        layers = frozenset(int(s) for s in spec.split(",") if s.strip())
    except ValueError:
        raise InputError(f"--dense-layers takes a comma list of layer ids or `all`, got {spec!r}") from None
    bad = sorted(layers - set(dsa_layers))
    if bad or not layers:
        raise InputError(f"--dense-layers {spec!r}: {bad or 'no layers'} not DSA layers; DSA layers are "
                         f"{sorted(dsa_layers)}")
    return layers


class _Capture:
    """Forward hooks on every layer's mixer: keep run A's outputs, compare run B's as they come."""

    def __init__(self, model: Any) -> None:
        self.mixers = [layer.self_attn for layer in model.model.layers]
        self.kept: list[list[torch.Tensor]] = [[] for _ in self.mixers]
        self.diffs: list[list[np.ndarray]] = [[] for _ in self.mixers]
        self.offset = [0] * len(self.mixers)
        self.mode = "keep"
        self.handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.mixers)]

    def _hook(self, i: int):
        def hook(module, args, output):
            out = output[0].detach().float().cpu()  # [T, hidden] of batch row 0
            if self.mode == "keep":
                self.kept[i].append(out)
            else:
                a = torch.cat(self.kept[i]) if len(self.kept[i]) > 1 else self.kept[i][0]
                self.kept[i] = [a]
                s = self.offset[i]
                self.diffs[i].append(relative_difference(a[s:s + len(out)].numpy(), out.numpy()))
                self.offset[i] = s + len(out)
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def compare_runs(model: Any, tokenizer: Any, text: str | None, *, dense_layers: Collection[int],
                 trace_a: str | Path, trace_b: str | Path, ids: list[int] | None = None, out: str | Path | None = None,
                 policy: "str | RecordPolicy | dict | None" = None, prefill_chunk: int = 2048,
                 overwrite: bool = False) -> Comparison:
    """Run the same input sparse (A) and with `dense_layers` forced dense (B), record both, compare.

    Args:
        model / tokenizer: a loaded model (`engine.load_model`) and its tokenizer.
        text / ids: the input (plain text, or token ids).
        dense_layers: DSA layer ids that run B reads densely.
        trace_a / trace_b: trace directories for the two runs.
        out: where to write the comparison (None: not written).
        policy: recording policy; by default `default` with every 16th prefill query's full list kept
            (the read comparison needs the same queries in both traces).
    """
    cfg = model.config
    dsa_layers = tuple(i for i in range(cfg.num_hidden_layers) if cfg.is_dsa_layer(i))
    dense = frozenset(int(l) for l in dense_layers)
    if not dense or not dense <= set(dsa_layers):
        raise InputError(f"dense layers {sorted(dense)} must be DSA layers ({list(dsa_layers)})")
    # every output is checked before anything runs: a refusal after two recordings wastes both
    for trace in (trace_a, trace_b):
        check_trace_target(trace, overwrite=overwrite)
    if out is not None:
        check_comparison_target(out, overwrite=overwrite, traces=(trace_a, trace_b))
    pol = load_policy(policy) if policy is not None else RecordPolicy(name="compare", dsa_prefill_stride=16)
    probe = Session(model, tokenizer, prefill_chunk=prefill_chunk)
    seg = probe.append(text, name="prompt") if ids is None else probe.append(ids=ids, name="prompt")
    n = seg.end - seg.start
    need = n * (cfg.hidden_size * cfg.num_hidden_layers + cfg.vocab_size) * 4
    if need > HOST_BYTES_LIMIT:
        raise InputError(f"{n} tokens would keep {need / 2**30:.1f} GiB of run A on the host "
                         f"(limit {HOST_BYTES_LIMIT / 2**30:.0f} GiB); compare a shorter prompt")
    tokens = list(probe.tokens)
    runtime = model.runtime
    saved = (runtime.dsa_force_dense, runtime.dsa_dense_layers)
    capture = _Capture(model)
    logits = {}
    try:
        for name, trace, layers in (("a", trace_a, frozenset()), ("b", trace_b, dense)):
            runtime.dsa_force_dense, runtime.dsa_dense_layers = False, layers
            capture.mode = "keep" if name == "a" else "compare"
            session = Session(model, tokenizer, prefill_chunk=prefill_chunk)
            with record(session, trace=trace, policy=pol, overwrite=overwrite) as rec:
                rec.writer.update_session(comparison={"run": name, "dense_layers": sorted(layers)})
                session.append(ids=tokens, name="prompt")
                logits[name] = session.prefill(return_logits=True).float().cpu().numpy()
    finally:
        capture.remove()
        runtime.dsa_force_dense, runtime.dsa_dense_layers = saved
    layer_rows = [pd.DataFrame({"layer": i, "position": np.arange(n), "rel_diff": np.concatenate(d)})
                  for i, d in enumerate(capture.diffs)]
    kl = pd.DataFrame({"position": np.arange(n), "kl": next_token_kl(logits["a"], logits["b"])})
    ta, tb = open_trace(trace_a), open_trace(trace_b)
    reads = read_changes(ta.table("dsa_topk", columns=["layer", "position", "selected"]),
                         tb.table("dsa_topk", columns=["layer", "position", "selected"]))
    result = Comparison(pd.concat(layer_rows, ignore_index=True), kl, reads, tuple(sorted(dense)), dsa_layers)
    if out is not None:
        result.write(out, overwrite=overwrite)
    return result
