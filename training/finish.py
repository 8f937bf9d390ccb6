"""The end of every training job: the trained model quantized (MXFP4 experts) and written in the real
layout with its loss curves beside it, reloaded with the engine's loader, and evaluated on held-out
needle prompts; the data files (eval.json, eval.csv, training.json) written next to it. Each job's
`finalize` (`training.demo_model`, `training.lengthen`, `training.extend`) combines these with its own
extra evaluations and model card.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

from engine.tokenizer import Tokenizer
from training.evaluate import needle_accuracy
from training.model_setup import export


def export_and_reload(model, config, out: Path, losses: dict[str, Path]):
    """Quantize + write the checkpoint with its loss curves beside it; return (dir, the model reloaded by
    the engine's loader onto the device `model` trained on): every evaluation runs on what users run
    (MXFP4 experts)."""
    from engine import load_model

    out = export(model, config, out)
    for name, source in losses.items():
        copy_if_present(source, out / name)
    return out, load_model(out, device=next(model.parameters()).device)


def held_out_needle(shipped, tok: Tokenizer, args, style: str = "key") -> list[dict]:
    """Needle accuracy of the written checkpoint at `--eval-lengths` x depths 10/50/90%, held-out wording."""
    lengths = [int(x) for x in args.eval_lengths.split(",") if x]
    counts = [int(x) for x in args.eval_samples.split(",") if x]
    samples = {n: counts[min(i, len(counts) - 1)] for i, n in enumerate(lengths)}
    print(f"evaluating the written checkpoint (MXFP4 experts) at {lengths} ...", flush=True)
    return needle_accuracy(shipped, tok, lengths=lengths, depths=(0.1, 0.5, 0.9), samples=samples, batch_tokens=8192,
                           style=style)


def write_eval_files(out: Path, config, run_info: dict, rows: list[dict], during_training: list, **extra) -> int:
    """eval.json (held-out needle rows, `extra` results, the evals during training), eval.csv and
    training.json beside the checkpoint; returns the checkpoint's size in bytes."""
    (out / "eval.json").write_text(json.dumps({"held_out_needle": rows, **extra, "during_training": during_training},
                                              indent=1) + "\n")
    with open(out / "eval.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    (out / "training.json").write_text(json.dumps({
        **run_info, "config": config.summary(), "checkpoint_bytes": size}, indent=1, default=str) + "\n")
    return size


def copy_if_present(src: Path, dst: Path) -> None:
    """A loss curve beside the checkpoint; a run without one (a base that kept none) is left out."""
    if src.exists():
        shutil.copyfile(src, dst)
