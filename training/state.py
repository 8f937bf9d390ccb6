"""Resumable training state on disk: safetensors + JSON only (no pickle), written atomically.

Layout of a state directory:
    latest.json                 {"step": N, "dir": "step-000N"}: replaced atomically after a save
    step-000N/model.safetensors every parameter and buffer of the trainable model
    step-000N/optim.safetensors each optimizer's moments, named `{opt}.{param}.{exp_avg|exp_avg_sq}`
    step-000N/state.json        step, optimizer step counts, run settings, metrics so far
    loss.csv                    one row per step (truncated to the resumed step on resume)
    train.log                   the run's output (when started as the README says)

A crash at any moment leaves `latest.json` pointing at a complete directory: the new step's
directory is written and flushed first, then `latest.json` is replaced, then older steps go.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.io.files import fsync_dir
from engine.weights.write import owned

LATEST = "latest.json"



def write_json_atomic(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _optimizer_tensors(name: str, opt: torch.optim.Optimizer, names: dict[int, str]) -> tuple[dict, dict]:
    tensors, steps = {}, {}
    for p, st in opt.state.items():
        pname = names[id(p)]
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                tensors[f"{name}.{pname}.{key}"] = st[key].detach().cpu().contiguous()
        if "step" in st:
            steps[pname] = float(st["step"])
    return tensors, steps


def save(state_dir: Path, step: int, model: torch.nn.Module, optimizers: dict[str, torch.optim.Optimizer],
         info: dict, keep: int = 2) -> Path:
    """Write step `step` and point `latest.json` at it; keep the newest `keep` step directories."""
    state_dir.mkdir(parents=True, exist_ok=True)
    final = state_dir / f"step-{step:07d}"
    tmp = state_dir / f".tmp-step-{step:07d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    # saved from host copies, so a state trained on any device loads onto any other
    save_file({k: owned(v.detach().cpu()) for k, v in model.state_dict().items()}, str(tmp / "model.safetensors"))
    names = {id(p): n for n, p in model.named_parameters()}
    tensors, steps = {}, {}
    for oname, opt in optimizers.items():
        t, s = _optimizer_tensors(oname, opt, names)
        tensors.update(t)
        steps[oname] = s
    save_file(tensors, str(tmp / "optim.safetensors"))
    write_json_atomic(tmp / "state.json", {"step": step, "optimizer_steps": steps, **info})
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(state_dir)
    write_json_atomic(state_dir / LATEST, {"step": step, "dir": final.name})
    old = sorted(p for p in state_dir.glob("step-*") if p.is_dir() and p != final)
    for p in old[: max(0, len(old) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def latest(state_dir: Path) -> Path | None:
    """The directory `latest.json` points at, or None for a fresh run."""
    pointer = state_dir / LATEST
    if not pointer.exists():
        return None
    try:
        d = state_dir / json.loads(pointer.read_text())["dir"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise RuntimeError(f"{pointer}: unreadable ({exc}); remove it to start over") from None
    if not (d / "state.json").exists():
        raise RuntimeError(f"{pointer} points at {d}, which is incomplete")
    return d


def load(d: Path, model: torch.nn.Module, optimizers: dict[str, torch.optim.Optimizer]) -> dict:
    """Restore model and optimizer moments from step directory `d`; returns its state.json."""
    info = json.loads((d / "state.json").read_text())
    weights = load_file(str(d / "model.safetensors"))
    own = model.state_dict()
    bad = sorted(set(own) ^ set(weights))
    if bad:
        raise RuntimeError(f"{d}: saved model does not match this configuration (first differences: {bad[:5]})")
    for k, v in weights.items():
        if own[k].shape != v.shape:
            raise RuntimeError(f"{d}: {k} has shape {list(v.shape)}, the model expects {list(own[k].shape)}")
    model.load_state_dict(weights)
    moments = load_file(str(d / "optim.safetensors"))
    params = dict(model.named_parameters())
    for oname, opt in optimizers.items():
        steps = info.get("optimizer_steps", {}).get(oname, {})
        for pname, count in steps.items():
            p = params[pname]
            # the moments live where their parameter does; the step count stays a host scalar (AdamW's default)
            opt.state[p] = {"step": torch.tensor(count),
                            "exp_avg": moments[f"{oname}.{pname}.exp_avg"].to(p.device, copy=True),
                            "exp_avg_sq": moments[f"{oname}.{pname}.exp_avg_sq"].to(p.device, copy=True)}
    return info


def _truncate_csv(path: Path, step: int) -> None:
    """Drop loss rows past `step` (a resumed run recomputes them)."""
    if not path.exists():
        return
    with open(path) as f:
        rows = list(csv.reader(f))
    if not rows:
        return
    keep = [rows[0]] + [r for r in rows[1:] if r and int(r[0]) < step]
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(keep)


def open_loss_log(path: Path, step: int, columns: list[str]):
    """The run's per-step loss CSV opened for appending at `step` (a resumed run recomputes the rows
    past it, so they are dropped first; a new file gets the header): (file, csv writer)."""
    _truncate_csv(path, step)
    new = not path.exists()
    f = open(path, "a", newline="")
    writer = csv.writer(f)
    if new:
        writer.writerow(columns)
    return f, writer


def base_settings(base: Path) -> tuple[Path, int, int]:
    """(last saved step directory, seed, topk) of a finished run that a continuation starts from
    (`training.extend`, `training.lengthen`); exits with a clear message when it holds no step."""
    last = latest(base)
    if last is None:
        raise SystemExit(f"{base}: no saved step (no latest.json): train the base model first")
    info = json.loads((last / "state.json").read_text())
    return last, int(info["seed"]), int(info["topk"])
