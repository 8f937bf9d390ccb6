"""Recording policies: what each recorder keeps raw and what it only counts.

The default policy keeps every trace bounded (spec section 2: <= 1.5 GB per 1M tokens at full K3.1
dimensions): DSA selections are counted per key bin / distance / segment / sink for every query,
but full index lists are kept only for decode steps, every `dsa_prefill_stride`-th prefill query and
marked positions or segments; KDA norms every `kda_every_tokens` tokens in prefill and every decode
token; MoE counts for every token, full routes for decode steps, sampled windows and marks.
`all` keeps everything raw. A JSON file with any of these fields overrides the default.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from engine.errors import InputError
from engine.io.files import read_limited


@dataclass(frozen=True)
class RecordPolicy:
    """Attributes:
    name: "default", "all" or the policy file's name.
    dsa_bin_tokens: width (tokens) of a key-position bin of the DSA heat map.
    sink_tokens: a query hits the attention sink when it selects one of the first sink_tokens positions.
    dsa_prefill_stride: keep the full index list of every stride-th prefill query (0 = none, 1 = all).
    dsa_decode_lists: keep the full index list of every decode step.
    dsa_scores: store indexer scores next to full index lists.
    dense_mass_stride: measure dense-attention mass inside the selected set for every stride-th prefill
        query (0 = never).
    dense_mass_decode_every: ... and for every n-th decode step (0 = never). Each measured step re-reads
        every past key of every DSA layer (a dense attention pass, growing with the context), so the
        default samples thinly (docs/benchmarks.md has the cost).
    kda_every_tokens: KDA norms every n prefill tokens (the KDA chunk is 64; decode: every token).
    kda_extras: also record max |S|, mean decay and mean beta, and the decay timescales (median
        channel half-life, share of global channels).
    kda_rank_every: effective rank of S (an SVD per head) at the measured boundaries every n tokens
        ((position + 1) % n == 0; 0 = never; opt-in: it costs an SVD of K x V per head).
    dense_overlap: with each dense-mass query also the IoU / recall of the selection against the dense
        top-k (opt-in).
    moe_decode_routes: keep the route of every decode token.
    moe_window_every / moe_window_tokens: keep routes of a window of tokens every n prefill tokens.
    mark_positions: positions whose full lists and routes are always kept.
    mark_segments: segment names whose tokens are always kept in full.
    flush_seconds: flush the trace this often while the session runs (live following), unless a flush
        would then take more than `flush_share` of the time.
    flush_share: the largest share of the session's time periodic flushes may take: after a flush
        that took d seconds the next waits at least d / flush_share (d: the flush's main-thread time,
        several tokens' worth on a CPU, plus the CPU time of the writer's last Parquet encoding, which
        takes a core from the engine). 1 = flush every flush_seconds.
    health: integrity checks (the `*_health` tables, `workbench.signals.integrity`): KDA states finite and
        bounded, frozen decay, chunked-vs-recurrent drift at each prefill call's first chunk, DSA and MoE
        ties, non-finite router logits. On by default (docs/recording.md has the cost).
    health_norm_max: a KDA head's state norm above this is a fault (healthy states stay orders below).
    health_drift_tol: relative state difference above which chunked prefill and token-by-token disagree
        (fp32 forms agree to ~1e-5).
    """

    name: str = "default"
    dsa_bin_tokens: int = 256
    sink_tokens: int = 4
    dsa_prefill_stride: int = 1024
    dsa_decode_lists: bool = True
    dsa_scores: bool = False
    dense_mass_stride: int = 8192
    dense_mass_decode_every: int = 64
    kda_every_tokens: int = 64
    kda_extras: bool = False
    kda_rank_every: int = 0
    dense_overlap: bool = False
    moe_decode_routes: bool = True
    moe_window_every: int = 16384
    moe_window_tokens: int = 64
    mark_positions: tuple[int, ...] = ()
    mark_segments: tuple[str, ...] = ()
    flush_seconds: float = 1.0
    flush_share: float = 0.02
    health: bool = True
    health_norm_max: float = 1e4
    health_drift_tol: float = 1e-3

    def __post_init__(self) -> None:
        _check_types(self)
        for name in ("dsa_bin_tokens", "sink_tokens", "kda_every_tokens", "moe_window_tokens"):
            if getattr(self, name) < 1:
                raise InputError(f"policy field `{name}` must be >= 1")
        for name in ("dsa_prefill_stride", "dense_mass_stride", "dense_mass_decode_every", "moe_window_every",
                     "kda_rank_every"):
            if getattr(self, name) < 0:
                raise InputError(f"policy field `{name}` must be >= 0")
        if not self.health_norm_max > 0 or not self.health_drift_tol > 0:
            raise InputError("policy fields `health_norm_max` and `health_drift_tol` must be positive")
        if self.flush_seconds <= 0:
            raise InputError("policy field `flush_seconds` must be positive")
        if not 0 < self.flush_share <= 1:
            raise InputError("policy field `flush_share` must be in (0, 1]")

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["mark_positions"], d["mark_segments"] = list(self.mark_positions), list(self.mark_segments)
        return d


_MAX_INT = 2 ** 31 - 1  # positions and strides are int32-sized


def _check_types(policy: RecordPolicy) -> None:
    """Every field has its declared type (JSON gives strings, floats, lists anywhere)."""
    for f in dataclasses.fields(policy):
        value = getattr(policy, f.name)
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if kind == "int":
            ok = isinstance(value, int) and not isinstance(value, bool) and -_MAX_INT <= value <= _MAX_INT
            want = "an integer"
        elif kind == "bool":
            ok, want = isinstance(value, bool), "true or false"
        elif kind == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            want = "a finite number"
        elif kind == "str":
            ok, want = isinstance(value, str), "a string"
        elif f.name == "mark_positions":
            ok = isinstance(value, tuple) and all(isinstance(v, int) and not isinstance(v, bool)
                                                  and 0 <= v <= _MAX_INT for v in value)
            want = f"a list of positions (integers 0..{_MAX_INT})"
        else:  # mark_segments
            ok, want = isinstance(value, tuple) and all(isinstance(v, str) for v in value), "a list of segment names"
        if not ok:
            raise InputError(f"policy field `{f.name}` must be {want}, got {value!r:.60}")


ALL = RecordPolicy(name="all", dsa_prefill_stride=1, dsa_scores=True, dense_mass_stride=256,
                   dense_mass_decode_every=1, kda_every_tokens=64, kda_extras=True, kda_rank_every=256,
                   dense_overlap=True, moe_window_every=1,
                   moe_window_tokens=1)


# a policy file is a few hundred bytes of fields (marked positions included); read through this limit
MAX_POLICY_BYTES = 1 << 20


def load_policy(spec: "str | RecordPolicy | dict | None") -> RecordPolicy:
    """`"default"`, `"all"`, a RecordPolicy, a dict of fields, or the path of a JSON file of fields."""
    if spec is None or spec == "default":
        return RecordPolicy()
    if isinstance(spec, RecordPolicy):
        return spec
    if spec == "all":
        return ALL
    if isinstance(spec, dict):
        fields = spec
        name = str(fields.get("name", "custom"))
    else:
        path = Path(spec)
        if not path.is_file():
            raise InputError(f"unknown policy {spec!r}: use default, all, or a JSON file of policy fields")
        try:
            fields = json.loads(read_limited(path, "a policy file", InputError, MAX_POLICY_BYTES).decode("utf-8"))
        except (UnicodeDecodeError, RecursionError) as exc:
            raise InputError(f"{path}: policy file is not UTF-8 JSON ({str(exc)[:120]})") from None
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}: policy file is not valid JSON ({exc})") from None
        if not isinstance(fields, dict):
            raise InputError(f"{path}: a policy file holds a JSON object of policy fields")
        name = path.stem
    known = {f.name for f in dataclasses.fields(RecordPolicy)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise InputError(f"unknown policy fields {unknown}; known: {sorted(known)}")
    values = {**fields, "name": name}
    where = "" if isinstance(spec, dict) else f"{spec}: "
    for key in ("mark_positions", "mark_segments"):
        if key in values:
            if not isinstance(values[key], (list, tuple)):
                raise InputError(f"{where}policy field `{key}` must be a list, got {values[key]!r:.60}")
            values[key] = tuple(values[key])
    try:
        return RecordPolicy(**values)
    except InputError as exc:
        raise InputError(f"{where}{exc}") from None
