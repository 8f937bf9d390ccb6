"""Integrity in every recording: the health tables, their checks and their reader.

The checks ride on the signals the layers already emit: `kda.state` (norms, plus the optional `frozen`
and `drift`), `dsa.topk` (plus `tie_band` / `tie_cut`) and `moe.route` (plus `logit_sum`, `kth_choice`,
`runner_up`); the measures themselves are `engine.ops.integrity` functions on plain tensors (what
`workbench conformance` calls on captures from other engines). This module adds to each of the three
families a health table (`kda_health`, `dsa_health`, `moe_health`, one layout) and, under a policy with
`health` on (the default), the integrity fields to its request and one row per check, layer and batch of
emissions (a prefill call, or the decode steps delivered together) to its rows. A row says how many
positions the check saw and how many failed, the first failing position and step (since when), the
head, and the worst value; the rows are counted on the device and copied at the flush like every other
table, so a failed check costs nothing more and never stops the session.

`health(trace)` folds the rows into one table per (check, layer); `findings(trace)` keeps the faults and
warnings; `summary_line(trace)` is the one line the questions, the CLI and the dashboard banner show.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from engine.probes import Emission, Marks, ProbeRequest
from workbench.signals.family import RecordingContext, RequestFn, RowsFn, SignalFamily, register, registered
from workbench.trace.errors import TraceError
from workbench.trace.schema import Column, TableSpec, signal_tags

if TYPE_CHECKING:
    import pandas as pd
    import torch

# check name -> (severity, what a failing row means); "fault": the model is not computing what it should;
# "warn": a precision loss that changes what the memory keeps; "note": a tie the documented rule decided
CHECKS: dict[str, tuple[str, str]] = {
    "kda.state_nonfinite": ("fault", "a KDA head's state holds NaN or inf"),
    "kda.state_norm": ("fault", "a KDA head's state norm exceeds policy.health_norm_max"),
    "kda.frozen_decay": ("warn", "decay rounds to exactly 1.0 in fp32: channels that never forget"),
    "kda.chunk_drift": ("fault", "the chunked prefill's state differs from the same tokens one by one by more than "
                        "policy.health_drift_tol"),
    "dsa.tie": ("note", "the selection was decided by a tie at rank k (earliest position first)"),
    "moe.router_nonfinite": ("fault", "non-finite router logits"),
    "moe.boundary_tie": ("note", "the best expert left out scored exactly the k-th chosen one: a tie decided the "
                         "route"),
}
SEVERITIES = ("fault", "warn", "note")
POLICY_FIELDS = ("health", "health_norm_max", "health_drift_tol")

# the integrity fields each family's probe is asked for when the policy has `health` on
FIELDS = {"kda.state": ("frozen", "drift"), "dsa.topk": ("tie_band", "tie_cut"),
          "moe.route": ("logit_sum", "kth_choice", "runner_up")}


def _health_table(family: str, signal: str) -> TableSpec:
    return TableSpec(f"{family}_health", f"integrity checks of the {family} layers: one row per check, layer and batch "
                     "of emissions (a prefill call or delivered decode steps)", (
        *signal_tags(),
        Column("check", pa.string(), "the check (workbench.signals.integrity.CHECKS)", encoding="dict"),
        Column("count", pa.int64(), "positions of the batch where the check failed"),
        Column("total", pa.int64(), "positions of the batch the check saw"),
        Column("first_position", pa.int64(), "first failing position of the batch (-1: none)", encoding="delta"),
        Column("first_step", pa.int32(), "step of that position (-1: none)", encoding="delta"),
        Column("head", pa.int16(), "head (KDA) at the first failing position (-1: none or not per head)"),
        Column("worst", pa.float32(), "worst value over the failing positions (NaN: none)", encoding="bss"),
        Column("last_position", pa.int64(), "last position the batch covered", encoding="delta"),
        Column("per_head", pa.list_(pa.float32()), "KDA, per head: failing positions (frozen decay: the most "
               "frozen channels; chunk drift: the largest drift); null in the DSA and MoE tables", True, "bss"),
    ), signal=signal)


def check_row(positions: "torch.Tensor | np.ndarray", steps: "torch.Tensor | np.ndarray", bad: Any, worst: Any,
              seen: Any = None, per_head: Any = None) -> dict[str, Any]:
    """One health row of a batch.

    On the host the row is made with numpy (the arrays are a handful of elements: torch's per-op dispatch
    would cost 3-5x more, and a CPU decode's flush makes ~60 of these rows); on a device it is counted
    there, with no synchronisation (the flush copies it with every other pending result). Both give the
    same row (tests/workbench/test_integrity_rows.py).

    Args:
        positions, steps: `[n]` int64 on the host, one per row of the batch.
        bad: `[n]` or `[n, H]` bool, where the check failed (per head: a row fails when any head does).
        worst: `[n]` float32, the row's value to report (its largest over the failing rows is kept).
        seen: `[n]` bool, rows the check measured (default: all).
        per_head: `[H]` float32 per-head figure, when the check is per head.
    """
    if isinstance(bad, np.ndarray):
        return _host_row(np.asarray(positions), np.asarray(steps), bad, worst, seen, per_head)
    return _device_row(positions, steps, bad, worst, seen, per_head)


def _host_row(positions: np.ndarray, steps: np.ndarray, bad: np.ndarray, worst: np.ndarray,
              seen: np.ndarray | None, per_head: np.ndarray | None) -> dict[str, Any]:
    rows = bad.any(-1) if bad.ndim == 2 else bad
    if seen is not None:
        rows = rows & seen
    failed = bool(rows.any())
    first = int(rows.argmax())
    out = {
        "step": steps[-1:].copy(),
        "count": np.array([rows.sum()], np.int64),
        "total": np.array([seen.sum() if seen is not None else len(rows)], np.int64),
        "first_position": np.array([positions[first] if failed else -1], np.int64),
        "first_step": np.array([steps[first] if failed else -1], np.int32),
        "head": np.array([bad[first].argmax() if failed and bad.ndim == 2 else -1], np.int16),
        "worst": np.array([worst[rows].astype(np.float32).max() if failed else -np.inf], np.float32),
        "last_position": positions[-1:].copy(),
    }
    if per_head is not None:
        out["per_head"] = per_head.astype(np.float32).reshape(1, -1)
    return out


def _device_row(positions: "torch.Tensor", steps: "torch.Tensor", bad: "torch.Tensor", worst: "torch.Tensor",
                seen: "torch.Tensor | None", per_head: "torch.Tensor | None") -> dict[str, Any]:
    import torch

    device = bad.device
    rows = bad.any(-1) if bad.dim() == 2 else bad
    if seen is not None:
        rows = rows & seen
    first = rows.int().argmax()  # 0 when none fails: masked below
    failed = rows.any()
    pos, stp = positions.to(device), steps.to(device)
    none = torch.tensor(-1, device=device)
    head = bad[first].int().argmax() if bad.dim() == 2 else none
    out = {
        "step": steps[-1:].clone(),
        "count": rows.sum().view(1),
        "total": (seen.sum() if seen is not None else torch.tensor(len(rows), device=device)).view(1),
        "first_position": torch.where(failed, pos[first], none).view(1),
        "first_step": torch.where(failed, stp[first], none).to(torch.int32).view(1),
        "head": torch.where(failed, head, none).to(torch.int16).view(1),
        "worst": torch.where(rows, worst.float(), torch.tensor(float("-inf"), device=device)).amax().view(1),
        "last_position": positions[-1:].clone(),
    }
    if per_head is not None:
        out["per_head"] = per_head.float().view(1, -1)
    return out


def _on_host(fields: dict, steps: "torch.Tensor") -> tuple[dict, Any]:
    """The fields and steps as numpy arrays when they live on the CPU (views, no copy; half precision
    widened to float32, which keeps every value and comparison), else as they are."""
    import torch

    if any(isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in fields.values()):
        return fields, steps

    def host(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        v = v.detach()
        return (v.float() if v.dtype in (torch.bfloat16, torch.float16) else v).numpy()

    return {k: host(v) for k, v in fields.items()}, host(steps)


# the few array functions the checks need, on numpy arrays (host) and torch tensors (device) alike
def _finite(x: Any) -> Any:
    return np.isfinite(x) if isinstance(x, np.ndarray) else x.isfinite()


def _amax(x: Any, dim: int) -> Any:
    return x.max(axis=dim) if isinstance(x, np.ndarray) else x.amax(dim)


def _float(x: Any) -> Any:
    return x.astype(np.float32) if isinstance(x, np.ndarray) else x.float()


def _count(x: Any, dim: int) -> Any:
    """True entries of a bool array along `dim`, as float32."""
    return _float(x.sum(dim))


def _nan_to(x: Any, nan: float, posinf: float | None = None, neginf: float | None = None) -> Any:
    """`x` with NaN (and, given, +-inf) replaced; infinities not given become the largest finite values
    (numpy's and torch's default alike)."""
    if isinstance(x, np.ndarray):
        return np.nan_to_num(x, nan=nan, posinf=posinf, neginf=neginf)
    return x.nan_to_num(nan, posinf, neginf)


def _pend(ctx: RecordingContext, family: str, layer: int, rank: int, check: str, row: dict[str, Any]) -> None:
    ctx.pend(f"{family}_health", layer, rank, {**row, "check": np.array([check], dtype=object)})


def kda_rows(ctx: RecordingContext, layer: int, rank: int, steps: "torch.Tensor", fields: dict) -> None:
    """KDA state checks: non-finite and out-of-bound norms, frozen decay, chunked-vs-recurrent drift."""
    from engine.ops.integrity import kda_state_faults

    fields, steps = _on_host(fields, steps)
    positions, norm = fields["positions"], fields["norm"]  # [n], [n, H]
    policy = ctx.policy
    nonfinite = ~_finite(norm)
    _pend(ctx, "kda", layer, rank, "kda.state_nonfinite",
          check_row(positions, steps, nonfinite, _count(nonfinite, -1), per_head=_count(nonfinite, 0)))
    large = kda_state_faults(norm, policy.health_norm_max) & ~nonfinite
    _pend(ctx, "kda", layer, rank, "kda.state_norm",
          check_row(positions, steps, large, _amax(_nan_to(norm, 0.0, 0.0, 0.0), -1), per_head=_count(large, 0)))
    if "frozen" in fields:
        frozen = fields["frozen"]
        _pend(ctx, "kda", layer, rank, "kda.frozen_decay",
              check_row(positions, steps, frozen > 0, _amax(frozen, -1), per_head=_amax(frozen, 0)))
    if "drift" in fields:
        drift = fields["drift"]
        measured = ~(drift != drift).all(-1)  # a row of NaN: not measured (token-by-token calls)
        # a head measured as NaN failed too (a non-finite state on either side)
        bad = measured[:, None] & ~(drift <= policy.health_drift_tol)
        filled = _nan_to(drift, float("inf"))
        _pend(ctx, "kda", layer, rank, "kda.chunk_drift", check_row(positions, steps, bad, _amax(filled, -1),
                                                                    seen=measured, per_head=_amax(filled, 0)))


def dsa_rows(ctx: RecordingContext, layer: int, rank: int, steps: "torch.Tensor", fields: dict) -> None:
    """DSA selection ties: rows whose selection the tie-break decided; worst = the widest tie band."""
    if "tie_cut" not in fields:
        return
    fields, steps = _on_host(fields, steps)
    _pend(ctx, "dsa", layer, rank, "dsa.tie",
          check_row(fields["positions"], steps, fields["tie_cut"] > 0, _float(fields["tie_band"])))


def moe_rows(ctx: RecordingContext, layer: int, rank: int, steps: "torch.Tensor", fields: dict) -> None:
    """MoE router checks: non-finite logits, ties at the top-k boundary (`engine.ops.integrity.router_verdicts`,
    in bulk over the batch: a router step only kept three numbers per token)."""
    if "logit_sum" not in fields:
        return
    fields, steps = _on_host(fields, steps)
    from engine.ops.integrity import router_verdicts

    positions, kth = fields["positions"], fields["kth_choice"]
    nonfinite, ties = router_verdicts(fields["logit_sum"], kth, fields["runner_up"])
    _pend(ctx, "moe", layer, rank, "moe.router_nonfinite", check_row(positions, steps, nonfinite, _float(nonfinite)))
    _pend(ctx, "moe", layer, rank, "moe.boundary_tie", check_row(positions, steps, ties, kth))


_CHECKERS = {"kda.state": kda_rows, "dsa.topk": dsa_rows, "moe.route": moe_rows}


def _with_health_request(inner: RequestFn) -> RequestFn:
    def request(name: str, policy: Any, marks: Marks) -> ProbeRequest:
        base = inner(name, policy, marks)
        extra = FIELDS.get(name, ()) if getattr(policy, "health", False) else ()
        return dataclasses.replace(base, optional=base.optional | frozenset(extra)) if extra else base
    return request


def _with_health_rows(inner: RowsFn) -> RowsFn:
    def to_rows(ctx: RecordingContext, name: str, layer: int, rank: int, items: list[Emission],
                steps: "torch.Tensor", fields: dict) -> None:
        inner(ctx, name, layer, rank, items, steps, fields)
        checker = _CHECKERS.get(name)
        if checker is not None and getattr(ctx.policy, "health", False) and len(fields.get("positions", ())):
            checker(ctx, layer, rank, steps, fields)
    return to_rows


def must_be_seen_now(columns: dict, known: set) -> bool:
    """A flush's health rows (merged columns) hold a fault or warning check failing at a (check, layer) that
    had not failed before in this recording (`known` remembers them): the trace gets them at this flush,
    so a reader sees since when. Clean rows, notes (ties) and a finding already written may wait for a
    later flush (`SignalFamily.may_wait`)."""
    failed = np.asarray(columns["count"]) > 0
    news = False
    for check, layer in zip(np.asarray(columns["check"])[failed], np.asarray(columns["layer"])[failed]):
        if CHECKS.get(check, ("fault",))[0] != "note" and (check, int(layer)) not in known:
            known.add((check, int(layer)))
            news = True
    return news


def install() -> None:
    """Add the health table, request fields and checks to the registered kda, dsa and moe families
    (once; `workbench.signals` calls it after registering them)."""
    signals = {"kda": "kda.state", "dsa": "dsa.topk", "moe": "moe.route"}
    # in registration order: re-registering each in turn leaves the families, and the tables (which the
    # writer flushes in order), as they were, each family's health table after its own
    for family, fam in registered().items():
        signal = signals.get(family)
        if signal is None or any(t.name == f"{family}_health" for t in fam.tables):
            continue
        health_table = f"{family}_health"
        register(dataclasses.replace(fam, tables=fam.tables + (_health_table(family, signal),),
                                     may_wait={**fam.may_wait, health_table: must_be_seen_now},
                                     request=_with_health_request(fam.request),
                                     to_rows=_with_health_rows(fam.to_rows),
                                     policy_fields=fam.policy_fields + POLICY_FIELDS))


HEALTH_TABLES = ("kda_health", "dsa_health", "moe_health")
SUMMARY_COLUMNS = ["check", "severity", "layer", "positions_failed", "positions_checked", "share", "since_position",
                   "since_step", "head", "last_failed_position", "worst", "meaning"]


def health(trace: Any) -> "pd.DataFrame":
    """One row per (check, layer) over the whole trace: how many positions the check saw and failed, the
    share, the first failing position and step (since when), the head there, the last failing position
    and the worst value. Empty when the trace holds no health rows (recorded before them, or health off)."""
    import pandas as pd

    frames = []
    for name in HEALTH_TABLES:
        try:
            df = trace.table(name).to_pandas()
        except (TraceError, KeyError):
            continue
        if len(df):
            frames.append(df)
    if not frames:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    rows = pd.concat(frames, ignore_index=True)
    out = []
    for (check, layer), group in rows.groupby(["check", "layer"], sort=True):
        failed = group[group["count"] > 0]
        first = failed.sort_values(["first_step", "first_position"]).iloc[0] if len(failed) else None
        checked = int(group["total"].sum())
        severity, meaning = CHECKS.get(check, ("note", "unknown check"))
        out.append({
            "check": check, "severity": severity, "layer": int(layer),
            "positions_failed": int(group["count"].sum()), "positions_checked": checked,
            "share": float(group["count"].sum()) / checked if checked else 0.0,
            "since_position": -1 if first is None else int(first["first_position"]),
            "since_step": -1 if first is None else int(first["first_step"]),
            "head": -1 if first is None else int(first["head"]),
            "last_failed_position": int(failed["first_position"].max()) if len(failed) else -1,
            "worst": float(failed["worst"].max()) if len(failed) else float("nan"),
            "meaning": meaning,
        })
    return pd.DataFrame(out, columns=SUMMARY_COLUMNS)


def findings(trace: Any, severities: tuple[str, ...] = ("fault", "warn")) -> "pd.DataFrame":
    """The (check, layer) rows of `health` that failed at least once, faults first, earliest first."""
    table = health(trace)
    bad = table[(table["positions_failed"] > 0) & table["severity"].isin(severities)].copy()
    # faults first, then since when; at one step the earlier layer first, its mixer's checks before its FFN's
    bad["_order"] = bad["severity"].map(SEVERITIES.index)
    bad["_check"] = bad["check"].map(lambda c: list(CHECKS).index(c) if c in CHECKS else len(CHECKS))
    order = ["_order", "since_step", "layer", "_check"]
    return bad.sort_values(order).drop(columns=["_order", "_check"]).reset_index(drop=True)


def summary_line(trace: Any) -> str:
    """One line: the first fault and where it began, or "no faults" with the warnings and the tie share."""
    table = health(trace)
    if table.empty:
        return "integrity: not checked (no health rows in this trace)"
    faults = findings(trace, ("fault",))
    if faults.empty:
        ties = table[table["check"] == "dsa.tie"]
        share = ties["positions_failed"].sum() / max(1, ties["positions_checked"].sum()) if len(ties) else 0.0
        warned = findings(trace, ("warn",))
        warnings = "".join(f"; warning: {check} at {len(group)} layer(s) (layer {int(group['layer'].iloc[0])} first)"
                            for check, group in warned.groupby("check", sort=True))
        return (f"integrity: no faults ({len(table)} checks by layer; {share:.1%} of DSA rows decided by the "
                f"documented tie-break{warnings})")
    top = faults.iloc[0]
    where = f"layer {top['layer']}" + (f" head {top['head']}" if top["head"] >= 0 else "")
    others = f"; {len(faults) - 1} more (check, layer) fault(s)" if len(faults) > 1 else ""
    return (f"integrity: fault {top['check']} at {where}, since position {top['since_position']} "
            f"(step {top['since_step']}): {top['meaning']}{others}")
