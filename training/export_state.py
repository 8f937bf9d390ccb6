"""Export a training state (any saved step, read-only) as the shipped checkpoint:
`python -m training.export_state --state STATE --out engine/builtin/demo`.

The same path as the end of `training.demo_model` (`finalize`): the weights of the step that
`latest.json` names (or `--step-dir`) go into the trainable model, `training.model_setup.export`
quantizes the experts to MXFP4 and writes the real layout with the tokenizer files, the written
checkpoint is reloaded with `engine.load_model` and evaluated on held-out needle prompts, and
`MODEL_CARD.md`, `eval.json`/`eval.csv`, `training.json` and `loss.csv` land beside it.

A state before the last step gives an interim checkpoint: its model card says so at the top (step N
of the schedule's total, with the accuracy just measured), so the wiring can be built and tested
before training finishes; re-running the command on the final state replaces it with no code change.
The state directory is only read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from engine.tokenizer import Tokenizer
from training import state as state_io
from training.demo_model import DEFAULT_STAGES, OPTION_DEFAULTS, finalize, schedule
from training.evaluate import summary
from training.model_card import eval_table
from training.model_setup import DEMO_SIZES, trainable_model, trained_demo_config

INTERIM_NOTE = """> **Interim checkpoint: training step {step} of {total}.** Exported from a training state while
> the run was still in progress (`python -m training.export_state`), so that the workbench can be wired
> and tested against the real on-disk layout. It is not the finished model; measured on the written
> checkpoint (MXFP4 experts) at this step, held-out needle exact-answer accuracy:
>
{table}
>
> The final checkpoint replaces this directory (`python -m training.export_state --state DIR --out
> engine/builtin/demo` on the finished state).

"""


def _keep_loss_rows(path: Path, step: int) -> None:
    """The copied loss curve may run past the exported step (the run goes on): keep steps < `step`."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    keep = lines[:1] + [ln for ln in lines[1:] if ln.split(",", 1)[0].isdigit() and int(ln.split(",", 1)[0]) < step]
    path.write_text("\n".join(keep) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state", type=Path, required=True, help="training state directory (read only)")
    p.add_argument("--step-dir", type=Path, default=None, help="a step directory (default: what latest.json names)")
    p.add_argument("--out", type=Path, default=Path("engine/builtin/demo"), help="checkpoint directory (replaced)")
    p.add_argument("--eval-lengths", type=str, default="2048", help="held-out evaluation lengths")
    p.add_argument("--eval-samples", type=str, default="4", help="samples per depth for each length")
    p.add_argument("--image-eval", type=int, default=96, help="held-out image questions (extension states)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    step_dir = args.step_dir or state_io.latest(args.state)
    if step_dir is None:
        raise SystemExit(f"{args.state}: no saved step (no latest.json)")
    info = json.loads((step_dir / "state.json").read_text())
    if "training.lengthen" in info.get("command", ""):  # a continuation (and the runs before it): its finalize
        return _export_lengthened(args, step_dir, info)
    if "base" in info:  # a `training.extend` state (the tower and longer documents): its own finalize
        return _export_extended(args, step_dir, info)
    seed, scale, topk = int(info["seed"]), float(info["scale"]), int(info["topk"])
    stages = schedule(scale, info.get("stage_spec", DEFAULT_STAGES))
    total = sum(s.steps for s in stages)
    step = int(info["step"])
    config = DEMO_SIZES[info.get("size", "demo")](topk, vision=int(info.get("image_every", 0)) > 0)
    model = trainable_model(config, seed)
    state_io.load(step_dir, model, {})
    model.eval()
    run_info = {k: info[k] for k in ("seed", "scale", "topk", "lr", "indexer_lr", "stages", *OPTION_DEFAULTS) if k in info}
    run_info["command"] = info.get("command", "python -m training.demo_model")
    run_info["commit"] = info.get("commit", "")
    run_info["exported_step"] = step
    run_info["exported_from"] = str(step_dir)
    print(f"exporting {step_dir} (step {step}/{total}) to {args.out} ...", flush=True)
    eval_args = argparse.Namespace(out=args.out, eval_lengths=args.eval_lengths, eval_samples=args.eval_samples)
    finalize(model, config, Tokenizer.byte_level(), eval_args, args.state, run_info, info.get("metrics", {"evals": []}))
    _keep_loss_rows(args.out / "loss.csv", step)
    if step < total:
        rows = json.loads((args.out / "eval.json").read_text())["held_out_needle"]
        table = "\n".join("> " + line for line in eval_table(rows).splitlines())
        card = args.out / "MODEL_CARD.md"
        card.write_text(INTERIM_NOTE.format(step=step, total=total, table=table) + card.read_text())
        print(f"interim checkpoint (step {step}/{total}): {summary(rows)}", flush=True)
    return 0


def _export_lengthened(args, step_dir: Path, info: dict) -> int:
    """A `training.lengthen` state: its weights through `lengthen.finalize` (the model card lists the
    chain of runs behind them, every run's loss curve lands beside the checkpoint)."""
    from training import lengthen

    config = trained_demo_config(int(info["topk"]), vision=int(info.get("image_every", 0)) > 0)
    model = trainable_model(config, int(info["seed"]))
    state_io.load(step_dir, model, {})
    model.eval()
    metrics = info.pop("metrics", {"evals": []})
    run_info = {k: v for k, v in info.items() if k != "optimizer_steps"}
    run_info["exported_step"], run_info["exported_from"] = int(info["step"]), str(step_dir)
    print(f"exporting {step_dir} (continuation step {info['step']}) to {args.out} ...", flush=True)
    eval_args = argparse.Namespace(state=args.state, loss_name="loss_lengthen.csv", eval_lengths=args.eval_lengths,
                                   eval_samples=args.eval_samples, answer_style=info.get("answer_style", "key"))
    return lengthen.finalize(model, Tokenizer.byte_level(), eval_args, args.out, run_info, metrics)


def _export_extended(args, step_dir: Path, info: dict) -> int:
    from training import extend

    step, total = int(info["step"]), sum(s.steps for s in extend.schedule(float(info["scale"])))
    config = trained_demo_config(int(info["topk"]), vision=True)
    model = trainable_model(config, int(info["seed"]))
    state_io.load(step_dir, model, {})
    model.eval()
    run_info = {k: info[k] for k in ("seed", "scale", "topk", "lr", "stages", "base", "command", "commit") if k in info}
    run_info["exported_step"], run_info["exported_from"] = step, str(step_dir)
    print(f"exporting {step_dir} (extension step {step}/{total}) to {args.out} ...", flush=True)
    eval_args = argparse.Namespace(out=args.out, eval_lengths=args.eval_lengths, eval_samples=args.eval_samples,
                                   state=args.state, image_eval=args.image_eval)
    extend.finalize(model, config, Tokenizer.byte_level(), eval_args, run_info, info.get("metrics", {"evals": []}))
    if step < total:
        print(f"interim checkpoint (extension step {step}/{total})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
