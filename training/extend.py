"""Second training run of the demo model: the vision tower and longer documents, continuing a
finished text run: `python -m training.extend --config training/configs/extend.toml --base TEXT_STATE --state S
--out D`.

Why a run of its own instead of more stages in `training.demo_model`: the tower must not train
from the first step (it collapses to one embedding for every picture while the language model
cannot read it yet), and the text model must already retrieve at
2K before longer documents pay off. So this run starts from the base run's last state (text model
weights; the tower and projector from the seeded random init, the tower rescaled as
`training.model_setup` does) and trains two stages, every step one text batch and one image batch:

1. `frozen`: the tower and the projector are frozen: their random features (informative: a linear
   probe reads the pictures' attributes from them) are what the language model must learn to read.
   A projector trained from the first step collapsed instead, as the tower does (the figures:
   training/README.md, "Why the design: figures behind the training modules"). The
   pictures are read with DSA forced dense (every key in view) while the indexer learns the dense
   distribution on them, as in DeepSeek V3.2's warm-up; text rows at 2,048 tokens keep the
   retrieval the base run learned;
2. `tower`: the projector trains, and the tower at `--tower-lr-scale` (0.1) of the projector's
   rate; pictures read sparse; text rows at 4,096 tokens with every fourth at 8,192, to stretch
   retrieval past the base run's 2K.

Text rows are read sparse (as trained) throughout, the indexer learning its KL target on them. Seeded
and resumable as `training.demo_model` (its own state directory, `training.state`);
batches are pure functions of (seed, step) in streams the base run never used. At the end the
experts are quantized, the checkpoint (with the tower) is written, reloaded with
`engine.load_model` and evaluated: held-out needle accuracy (`training.evaluate`) and held-out
image questions with their swapped-image control (`training.image_tasks.image_accuracy`).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.tokenizer import Tokenizer
from training import state as state_io
from training import run_config, trainer
from training.finish import export_and_reload, held_out_needle, write_eval_files
from training.trainer import StepResult, weighted_loss
from training.model_card import eval_table, image_line, images_text
from training.distill import ExpertBalance, IndexerDistill, query_rows
from training.evaluate import needle_accuracy, summary
from training.image_tasks import forward_with_images, image_accuracy, image_batch
from training.model_setup import trainable_model, trained_demo_config
from training.tasks import W_KEY_LATE, batch

# Text batches of this run are `training.tasks.batch(step + TEXT_STREAM)`: the base run used
# steps 0..1559 of the same generator, so its batches are never repeated.
TEXT_STREAM = 1_000_000


@dataclass(frozen=True)
class Stage:
    phase: str        # "frozen" (tower frozen) | "tower" (tower trained at a reduced rate)
    steps: int
    text_length: int  # one text row per step; "tower" steps stretch every fourth to 2x
    image_batch: int
    image_length: int


def schedule(scale: float) -> list[Stage]:
    """About 60 minutes on one free CPU core at scale 1."""
    base = [Stage("frozen", 300, 2048, 8, 256), Stage("tower", 200, 4096, 8, 256)]
    # scale 0: no steps, the base model with the tower's seeded init attached (a tower that runs
    # but was never trained: what the shipped demo carries until an extension run reads pictures)
    return [Stage(s.phase, 0 if scale == 0 else max(1, round(s.steps * scale)), s.text_length, s.image_batch,
                  s.image_length) for s in base]


def stage_at(stages: list[Stage], step: int) -> Stage:
    return stages[trainer.stage_index((s.steps for s in stages), step)]


def text_length_at(stage: Stage, step: int) -> int:
    return stage.text_length * 2 if stage.phase == "tower" and step % 4 == 3 else stage.text_length


LR_WARMUP, LR_FLOOR = 30, 0.2   # the rates' warm-up steps and their floor (a share of each peak) at the end


def load_base(base_dir: Path, model: torch.nn.Module) -> dict:
    """The base run's last text-model weights into `model` (whose tower keeps its fresh init).
    Every non-vision tensor must be there with its shape; nothing else may be."""
    d = state_io.latest(base_dir)
    if d is None:
        raise SystemExit(f"{base_dir}: no saved step (no latest.json): train the base model first")
    info = json.loads((d / "state.json").read_text())
    weights = load_file(str(d / "model.safetensors"))
    own = model.state_dict()
    text = {k for k in own if not k.startswith("vision.")}
    if set(weights) != text:
        raise SystemExit(f"{d}: base weights do not match the text model "
                         f"(first differences: {sorted(set(weights) ^ text)[:5]})")
    for k, v in weights.items():
        if own[k].shape != v.shape:
            raise SystemExit(f"{d}: {k} has shape {list(v.shape)}, the model expects {list(own[k].shape)}")
    model.load_state_dict(weights, strict=False)
    return {"base_dir": str(d), "base_step": int(info["step"]), "base_commit": info.get("commit", ""),
            "base_command": info.get("command", ""), "seed": int(info["seed"]), "topk": int(info["topk"])}


COLUMNS = ["step", "phase", "text_length", "text_loss", "answer_loss", "image_loss", "image_answer_loss",
           "indexer_kl", "lr_scale", "tokens_per_s"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True, help="the finished base run's state directory (read only)")
    p.add_argument("--state", type=Path, required=True, help="this run's resumable state directory")
    p.add_argument("--out", type=Path, required=True, help="final checkpoint directory")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every stage's steps (0.01 = smoke test)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=1.5e-3, help="peak rate of the language model (reading pictures "
                   "is new to it: at 6e-4 it had not begun after 300 steps)")
    p.add_argument("--projector-lr", type=float, default=3e-3, help="peak rate of the (new) projector")
    p.add_argument("--tower-lr-scale", type=float, default=0.1, help="tower rate / projector rate in stage 2")
    p.add_argument("--indexer-lr", type=float, default=1e-3)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-lengths", type=str, default="2048,8192")
    p.add_argument("--eval-samples", type=str, default="8,4")
    p.add_argument("--image-eval", type=int, default=96, help="held-out image questions in the final evaluation")
    p.add_argument("--stop-after", type=int, default=None)
    p.add_argument("--no-final", action="store_true")
    return p


class ExtendJob:
    """The extension: every step one text row (`training.tasks.batch(seed, TEXT_STREAM + step)`, read
    sparse) and one batch of picture questions (dense while the tower is frozen, then sparse), each
    parameter group (text, projector, tower, indexer) with its own AdamW."""

    name = "extend"
    columns = COLUMNS

    def __init__(self, args: argparse.Namespace, seed: int, topk: int) -> None:
        self.args, self.seed, self.topk = args, seed, topk
        self.stages = SPEC.stages(args)
        self.total = sum(s.steps for s in self.stages)
        self.tok = Tokenizer.byte_level()
        self.config = SPEC.model_config(args, topk)
        self.model = trainable_model(self.config, seed)
        self.distill = IndexerDistill(self.model)
        self.balance = ExpertBalance(self.model)
        self.params = dict(self.model.named_parameters())
        params = self.params
        self.groups = {"indexer": [n for n in params if ".indexer." in n],
                       "tower": [n for n in params if n.startswith("vision.vision_tower.")],
                       "projector": [n for n in params if n.startswith("vision.mm_projector.")]}
        frozen = {n for n in params if n.endswith("e_score_correction_bias")}
        grouped = set().union(*self.groups.values())
        self.groups["text"] = [n for n in params if n not in grouped and n not in frozen]
        for n in frozen:
            params[n].requires_grad_(False)
        self.peak = {"text": args.lr, "projector": args.projector_lr,
                     "tower": args.projector_lr * args.tower_lr_scale, "indexer": args.indexer_lr}
        self.optimizers = {
            g: torch.optim.AdamW(trainer.decay_groups(((n, params[n]) for n in names), 0.01 if g != "indexer" else 0.0),
                                 lr=self.peak[g], betas=trainer.BETAS)
            for g, names in self.groups.items()}
        self.gen = torch.Generator()

    def start(self, resumed: dict | None, run_info: dict) -> None:
        if resumed is not None:
            run_info["base"] = resumed.get("base", {})
        else:
            run_info["base"] = load_base(self.args.base, self.model)
            print(f"starting from {run_info['base']['base_dir']} (base step {run_info['base']['base_step']})",
                  flush=True)
        run_info.update(seed=self.seed, topk=self.topk)
        self.model.runtime.dsa_force_dense = False

    def train_step(self, step: int) -> StepResult:
        model, distill, gen, params = self.model, self.distill, self.gen, self.params
        stage = stage_at(self.stages, step)
        scale = trainer.warmup_cosine(step, self.total, LR_WARMUP, LR_FLOOR)
        for g, opt in self.optimizers.items():
            for pg in opt.param_groups:
                pg["lr"] = self.peak[g] * (scale if g != "indexer" else 1.0)
        tower_on = stage.phase == "tower"
        for n in self.groups["tower"] + self.groups["projector"]:
            params[n].requires_grad_(tower_on)

        # text: the model on the LM loss, the indexer on KL over its selected keys
        length = text_length_at(stage, step)
        ids, weights = SPEC.data(self, step, stage)
        gen.manual_seed(self.seed * 1_000_003 + TEXT_STREAM + step)
        distill.active, distill.sparse = True, True
        distill.rows = query_rows(weights, 64, gen)
        text_loss, text_answer = weighted_loss(model(ids), ids, weights)
        kl = distill.take()
        (text_loss + (kl if kl is not None else 0.0)).backward()
        n_tokens = ids.numel()

        # images: while the tower is frozen the rows are read densely (the language model learns to
        # read the picture with every key in view, the indexer learns the dense distribution, as in
        # DeepSeek V3.2's warm-up); then sparse, the indexer on KL over its selected keys
        ids, weights, images, mask = image_batch(self.tok, self.seed, step, stage.image_batch, stage.image_length,
                                                 vision=self.config.vision, key_weight=W_KEY_LATE)
        model.runtime.dsa_force_dense = not tower_on
        distill.sparse = tower_on
        distill.rows = query_rows(weights, 64, gen)
        try:
            image_loss, image_answer = weighted_loss(forward_with_images(model, ids, images, mask), ids, weights)
        finally:
            model.runtime.dsa_force_dense = False
        image_kl = distill.take()
        (image_loss + (image_kl if image_kl is not None else 0.0)).backward()
        distill.active = False
        n_tokens += ids.numel()

        for g, opt in self.optimizers.items():
            if g in ("tower", "projector") and not tower_on:
                continue
            trainer.clipped_step((params[n] for n in self.groups[g]), opt)
        self.balance.update()
        distill.coverage = []
        text_loss, image_loss = float(text_loss.detach()), float(image_loss.detach())
        kl_value = float(kl.detach()) if kl is not None else float("nan")
        row = [step, stage.phase, length, f"{text_loss:.5f}", f"{text_answer:.5f}", f"{image_loss:.5f}",
               f"{image_answer:.5f}", f"{kl_value:.5f}", f"{scale:.4f}"]

        def describe(ema: float, done: int) -> tuple[str, str]:
            head = f"{stage.phase} L={length} text {text_loss:.3f} "
            return (head + f"image {image_loss:.3f} ans {image_answer:.3f} {ema:.0f} tok/s",
                    head + f"answer {text_answer:.3f} image {image_loss:.3f} image-answer {image_answer:.3f} "
                    f"kl {kl_value:.3f} {ema:.0f} tok/s")
        return StepResult(row, n_tokens, describe)

    def quick_eval(self, step: int, metrics: dict) -> None:
        model, tok, vision = self.model, self.tok, self.config.vision
        images_eval = image_accuracy(model, tok, 48, seed=1, vision=vision)
        control = image_accuracy(model, tok, 48, seed=1, vision=vision, swap_images=True)
        rows = needle_accuracy(model, tok, lengths=(2048,), samples=2, modes=("sparse",))
        metrics["evals"].append({"step": step, "image": images_eval, "image_swapped": control, "needle": rows})
        print(f"eval step {step}: images {image_line(images_eval, control)}; needle {summary(rows)}", flush=True)


def text_batch(job: ExtendJob, step: int, stage: Stage) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s one text row, `training.tasks.batch(seed, TEXT_STREAM + step)`, at the stage's length."""
    return batch(job.tok, job.seed, TEXT_STREAM + step, 1, text_length_at(stage, step))


SPEC = trainer.TrainSpec("extend", build_parser, model_config=lambda args, topk: trained_demo_config(topk, vision=True),
                         stages=lambda args: schedule(args.scale), data=text_batch)


def main(argv: list[str] | None = None) -> int:
    args = SPEC.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.state.mkdir(parents=True, exist_ok=True)
    _, seed, topk = state_io.base_settings(args.base)
    job = ExtendJob(args, seed, topk)

    def same_scale(info: dict) -> None:
        if info.get("scale") != args.scale:
            raise SystemExit(f"{args.state} holds a run with scale {info.get('scale')}; "
                             "pass the same or another --state")

    run_info = {"command": trainer.command_line("training.extend", argv), "scale": args.scale, "lr": job.peak,
                "stages": [asdict(s) for s in job.stages], "commit": trainer.git_commit(), **run_config.recorded(args)}
    limits = trainer.Limits(job.total, args.save_every, args.eval_every, args.stop_after)
    outcome, metrics = trainer.train(job, args.state, run_info, limits, check=same_scale)
    if outcome.reason == "stop-after":
        return 0
    job.distill.remove()
    if args.no_final:
        return 0
    return finalize(job.model, job.config, job.tok, args, run_info, metrics)


def finalize(model, config, tok: Tokenizer, args, run_info: dict, metrics: dict) -> int:
    """Quantize + write the checkpoint with its tower, reload it with the engine's loader, evaluate."""
    out, shipped = export_and_reload(model, config, args.out, {
        "loss_extend.csv": args.state / "loss.csv",
        "loss.csv": Path(run_info["base"]["base_dir"]).parent / "loss.csv"})
    rows = held_out_needle(shipped, tok, args)
    images = image_accuracy(shipped, tok, args.image_eval, seed=7, vision=config.vision)
    control = image_accuracy(shipped, tok, args.image_eval, seed=7, vision=config.vision, swap_images=True)
    size = write_eval_files(out, config, run_info, rows, metrics["evals"], held_out_images=images,
                            held_out_images_swapped=control)
    (out / "EVAL.md").write_text(
        "# Measured on the written checkpoint (MXFP4 experts, loaded with engine.load_model)\n\n"
        "## Held-out needle retrieval (value given the key / prompts, whole response in brackets)\n\n"
        f"{eval_table(rows)}\n{images_text(images, control)[0]}")
    print(f"wrote {out} ({size / 2**20:.1f} MiB); needle: {summary(rows)}; images {images['correct']}/"
          f"{images['total']} (swapped control {control['correct']}/{control['total']})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
