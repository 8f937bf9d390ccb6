"""Train the built-in demo model: `python -m training.demo_model --out checkpoints/trained-demo`.

Seeded and resumable: every batch is a pure function of (seed, step) (`training.tasks.batch`), and
the run saves its whole state (weights, optimizer moments, step) every `--save-every` steps to
`--state` (safetensors + JSON, atomic). Running the same command again resumes from there, after
any interruption. At the end the model is quantized (MXFP4 experts) and written to `--out` in the
real on-disk layout, reloaded with `engine.load_model`, and evaluated on held-out needle prompts;
`loss.csv`, `eval.json`/`eval.csv` and `training.json` are written next to the checkpoint.

Schedule (DeepSeek V3.2's order for the sparse layers):
1. dense: the whole model learns with DSA forced dense (`runtime.dsa_force_dense`), short
   sequences growing 256 -> 1024 tokens;
2. indexer warm-up: everything else frozen; the indexer learns the head-summed, L1-normalised
   dense attention distribution of its layer (KL, `training.distill`);
3. sparse: DSA selection on (top-k 64 < sequence length, so selection matters), the model on the
   language-model loss, the indexer on KL over its selected keys; sequences 1024 -> 2048 tokens.

Gradients flow through the engine's own layers (`engine.model.KimiForCausalLM`, pure-torch ops).
This module holds the run's step (`DemoJob`); the loop, saves and resuming are `training.trainer`'s.
`--config training/configs/builtin_demo_1_v4img.toml` gives the settings of builtin:demo's first run.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.tokenizer import Tokenizer
from training import device as device_io
from training import run_config, trainer
from training.distill import ExpertBalance, IndexerDistill, query_rows
from training.evaluate import needle_accuracy, summary
from training.finish import export_and_reload, held_out_needle, write_eval_files
from training.image_tasks import forward_with_images, image_accuracy, image_batch
from training.model_card import image_line, write_model_card
from training.model_setup import DEMO_SIZES, trainable_model
from training.tasks import DRILL_SHARE, batch, key_weight_at
from training.trainer import StepResult, tokens_left, weighted_loss
from training.wording import row_world
from workbench.retrieval_text import ANSWER_STYLES

__all__ = ["DEFAULT_STAGES", "Stage", "export_and_reload", "finalize", "held_out_needle", "main", "parse_stages",
           "schedule", "tokens_left", "weighted_loss", "write_eval_files"]


@dataclass(frozen=True)
class Stage:
    phase: str      # "dense" | "warmup" | "sparse"
    steps: int
    batch: int
    length: int


DEFAULT_STAGES = "dense:800x8x512,dense:250x4x1024,warmup:60x4x1024,sparse:250x4x1024,sparse:200x2x2048"
PHASES = ("dense", "warmup", "sparse")


def parse_stages(text: str) -> list[Stage]:
    """`PHASE:STEPSxBATCHxLENGTH,...` -> stages (a clear error for anything else)."""
    stages = []
    for part in text.split(","):
        phase, _, sizes = part.strip().partition(":")
        try:
            steps, size, length = (int(x) for x in sizes.split("x"))
        except ValueError:
            raise SystemExit(f"--stages: {part!r} is not PHASE:STEPSxBATCHxLENGTH (e.g. dense:800x8x512)") from None
        if phase not in PHASES or min(steps, size, length) < 1:
            raise SystemExit(f"--stages: {part!r}: the phase must be one of {PHASES} and every size at least 1")
        stages.append(Stage(phase, steps, size, length))
    return stages


def schedule(scale: float, stages: str = DEFAULT_STAGES) -> list[Stage]:
    """About 90 minutes on 2 free CPU cores at scale 1 with the default stages (4,096 tokens per step)."""
    return [Stage(s.phase, max(1, round(s.steps * scale)), s.batch, s.length) for s in parse_stages(stages)]


def stage_at(stages: list[Stage], step: int) -> tuple[int, Stage]:
    i = trainer.stage_index((s.steps for s in stages), step)
    return i, stages[i]


def lr_at(step: int, total: int, peak: float, warmup: int = 40, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup   # this rounding, not peak * ((step + 1) / warmup): the saved runs'
    return peak * trainer.warmup_cosine(step, total, warmup, floor)


# Options added after the first shipped run; a state saved before them ran with these values.
OPTION_DEFAULTS = {"stage_spec": DEFAULT_STAGES, "varied_share": 0.0, "gaps": False, "drill_share": DRILL_SHARE,
                   "first_weight": None, "answer_style": "key", "image_every": 0, "image_batch": 8,
                   "image_length": 256, "tower_from": 0, "tower_lr_scale": 0.1, "size": "demo"}

LOSS_COLUMNS = ["step", "phase", "length", "loss", "answer_loss", "indexer_kl", "topk_mass", "lr", "tokens_per_s",
                "expert_max_load"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("checkpoints/trained-demo"), help="final checkpoint directory")
    p.add_argument("--state", type=Path, default=None, help="resumable state directory (default: OUT.state)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=float, default=1.0, help="multiply every stage's steps (0.01 = smoke test)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on a shared, oversubscribed "
                   "machine 2 OpenMP threads measured 10x slower than 1)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--indexer-lr", type=float, default=3e-3)
    p.add_argument("--topk", type=int, default=64, help="DSA keys per query (trained and shipped)")
    p.add_argument("--save-every", type=int, default=25, help="steps between saved states")
    p.add_argument("--eval-every", type=int, default=150, help="steps between quick held-out evaluations")
    p.add_argument("--eval-lengths", type=str, default="2048,8192,32768", help="final evaluation lengths")
    p.add_argument("--eval-samples", type=str, default="8,4,2", help="samples per depth for each final length")
    p.add_argument("--no-final", action="store_true", help="stop after training (no export/evaluation)")
    p.add_argument("--stop-after", type=int, default=None, help="save and exit after this step (tests resuming)")
    p.add_argument("--eval-samples-during", type=int, default=2, help="held-out samples per depth in quick evals")
    p.add_argument("--stages", type=str, default=DEFAULT_STAGES, help="PHASE:STEPSxBATCHxLENGTH,... (before --scale)")
    p.add_argument("--varied-share", type=float, default=0.0,
                   help="rows whose facts are worded afresh (training.wording.varied_world); 0: the six TRAIN wordings")
    p.add_argument("--gaps", action="store_true", help="varied wordings put made-up words/symbols between key and value")
    p.add_argument("--drill-share", type=float, default=DRILL_SHARE, help="rows that are recall drills")
    p.add_argument("--first-weight", type=float, default=None, help="loss weight of each answer's first value token")
    p.add_argument("--answer-style", choices=ANSWER_STYLES, default="key",
                   help="key: answers `key: value`; span: the document quoted from the key through the value")
    p.add_argument("--image-every", type=int, default=0,
                   help="every Nth step (outside the indexer warm-up) also trains on a batch of image questions "
                        "(training.image_tasks; the model carries the vision tower); 0: text only")
    p.add_argument("--image-batch", type=int, default=8, help="image questions per image batch")
    p.add_argument("--image-length", type=int, default=256, help="tokens per image-question row")
    p.add_argument("--tower-from", type=int, default=0,
                   help="step from which the projector trains, and the tower at --tower-lr-scale of its rate; "
                        "before it both stay at their seeded init (a tower trained from the start collapses)")
    p.add_argument("--tower-lr-scale", type=float, default=0.1)
    p.add_argument("--size", choices=sorted(DEMO_SIZES), default="demo",
                   help="demo: trained_demo_config (6 layers, hidden 128); gpu: gpu_demo_config (9 layers, hidden 256)")
    p.add_argument("--device", choices=device_io.DEVICES, default="cpu",
                   help="where the model, batches and optimizer states live (auto: CUDA when visible)")
    p.add_argument("--precision", choices=device_io.PRECISIONS, default="auto",
                   help="auto: bf16 autocast on CUDA, fp32 on the CPU")
    p.add_argument("--image-eval", type=int, default=96,
                   help="held-out image questions in the final evaluation (half as many in the quick ones)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds of training after which the run saves and stops (the schedule is not replanned)")
    return p


def options_of(args: argparse.Namespace) -> dict:
    """The data and schedule settings a resumed run must share with the state it resumes."""
    return {"stage_spec": args.stages, "varied_share": args.varied_share, "gaps": args.gaps,
            "drill_share": args.drill_share, "first_weight": args.first_weight, "answer_style": args.answer_style,
            "image_every": args.image_every, "image_batch": args.image_batch, "image_length": args.image_length,
            "tower_from": args.tower_from, "tower_lr_scale": args.tower_lr_scale, "size": args.size}


class DemoJob:
    """The from-scratch run: text batches `training.tasks.batch(seed, step)` through the dense ->
    indexer warm-up -> sparse stages (module docstring), with a batch of picture questions every
    `image_every`th step outside the warm-up."""

    name = "training"

    def __init__(self, args: argparse.Namespace, device: torch.device, bf16: bool) -> None:
        self.args, self.device = args, device
        self.stages = SPEC.stages(args)
        self.total = sum(s.steps for s in self.stages)
        self.images_on = args.image_every > 0
        self.config = SPEC.model_config(args, args.topk)
        self.tok = Tokenizer.byte_level()
        self.model = trainable_model(self.config, args.seed).to(device)   # seeded on the CPU: the same init anywhere
        # the pure-torch ops everywhere: no Triton kernel in a graph that trains
        self.model.runtime.kernels = "reference"
        self.distill = IndexerDistill(self.model)
        self.balance = ExpertBalance(self.model)
        self.params = trainer.LanguageModelParams.of(self.model)
        self.optimizers = self.params.optimizers(args.lr, args.indexer_lr)
        self.columns = LOSS_COLUMNS + (["image_loss"] if self.images_on else [])
        self.worlds = None
        self.gen = torch.Generator().manual_seed(args.seed)
        self.amp = device_io.autocast(device, bf16)
        self.last_image = float("nan")   # the log line shows the latest image batch's loss
        # the main schedule skips the warm-up steps: its cosine runs over dense + sparse steps
        self.dense_total = sum(s.steps for s in self.stages if s.phase != "warmup")

    def start(self, resumed: dict | None, run_info: dict) -> None:
        # no draw at all when no row is reworded, so the first shipped run's batches are unchanged
        self.worlds = None if self.args.varied_share <= 0 else row_world(self.args.varied_share, self.args.gaps)

    def train_step(self, step: int) -> StepResult:
        args, model, distill, gen = self.args, self.model, self.distill, self.gen
        opt = self.optimizers
        main_params, index_params, vision_params = self.params.main, self.params.indexer, self.params.vision
        _, stage = stage_at(self.stages, step)
        ids, weights = SPEC.data(self, step, stage)
        gen.manual_seed(args.seed * 1_000_003 + step)
        warmup = stage.phase == "warmup"
        model.runtime.dsa_force_dense = stage.phase != "sparse"
        distill.active = stage.phase in ("warmup", "sparse")
        distill.sparse = stage.phase == "sparse"
        distill.rows = query_rows(weights, 64, gen) if distill.active else None
        ids, weights = ids.to(self.device), weights.to(self.device)
        for q in index_params.values():
            q.requires_grad_(distill.active)
        for q in main_params.values():
            q.requires_grad_(not warmup)
        image_step = self.images_on and not warmup and step % args.image_every == 0
        vision_on = image_step and step >= args.tower_from
        for q in vision_params.values():
            q.requires_grad_(vision_on)
        main_step = sum(min(s.steps, max(0, step - sum(x.steps for x in self.stages[:i])))
                        for i, s in enumerate(self.stages) if s.phase != "warmup")
        lr = lr_at(main_step, self.dense_total, args.lr)
        for g in opt["main"].param_groups:
            g["lr"] = lr
        for g in opt["indexer"].param_groups:
            g["lr"] = args.indexer_lr
        if vision_params:
            opt["vision"].param_groups[0]["lr"], opt["vision"].param_groups[1]["lr"] = lr, lr * args.tower_lr_scale
        loss_value = answer_value = image_value = float("nan")
        n_tokens = ids.numel()
        if warmup:
            with torch.no_grad(), self.amp:
                model(ids)
            kl = distill.take()
            assert kl is not None
            kl.backward()
            trainer.clipped_step(index_params.values(), opt["indexer"])
        else:
            with self.amp:
                logits = model(ids)
                loss, answer_value = weighted_loss(logits, ids, weights)
                kl = distill.take()
            del logits
            (loss + (kl if kl is not None else 0.0)).backward()
            if image_step:
                image_value, image_kl, n_image = image_loss_step(model, self.tok, distill, gen, args, step,
                                                                 stage.phase, self.amp)
                kl = kl if image_kl is None else (image_kl if kl is None else kl + image_kl)
                self.last_image = image_value
                n_tokens += n_image
            trainer.clipped_step(main_params.values(), opt["main"])
            if vision_on:
                trainer.clipped_step(vision_params.values(), opt["vision"])
            if kl is not None:
                trainer.clipped_step(index_params.values(), opt["indexer"])
            loss_value = float(loss.detach())
        max_load = self.balance.update()
        kl_value = float(kl.detach()) if kl is not None else float("nan")
        coverage = sum(distill.coverage) / len(distill.coverage) if distill.coverage else float("nan")
        distill.coverage = []
        row = [step, stage.phase, stage.length, f"{loss_value:.5f}", f"{answer_value:.5f}", f"{kl_value:.5f}",
               f"{coverage:.4f}", f"{lr:.6f}", f"{max_load:.2f}"] + ([f"{image_value:.5f}"] if self.images_on else [])

        def describe(ema: float, done: int) -> tuple[str, str]:
            head = f"{stage.phase} L={stage.length} loss {loss_value:.3f} "
            return (head + f"ans {answer_value:.3f} kl {kl_value:.3f} {ema:.0f} tok/s",
                    head + f"answer {answer_value:.3f} kl {kl_value:.3f} topk-mass {coverage:.2f} lr {lr:.2e} "
                    + (f"image {self.last_image:.3f} " if self.images_on else "") + f"{ema:.0f} tok/s "
                    f"ETA {tokens_left(self.stages, done) / max(ema, 1) / 60:.0f} min")
        return StepResult(row, n_tokens, describe)

    def quick_eval(self, step: int, metrics: dict) -> None:
        args, model, tok = self.args, self.model, self.tok
        _, stage = stage_at(self.stages, step - 1)
        self.distill.active = False  # quick evals are plain forwards
        rows = needle_accuracy(model, tok, lengths=(stage.length,), depths=(0.1, 0.5, 0.9),
                               samples=args.eval_samples_during, modes=("sparse", "dense"), style=args.answer_style)
        metrics["evals"].append({"step": step, "rows": rows})
        print(f"eval step {step} (held-out needle, in-memory fp32 model): {summary(rows)}", flush=True)
        if self.images_on:
            n_images = max(1, args.image_eval // 2)
            pictures = image_accuracy(model, tok, n_images, seed=1, vision=self.config.vision)
            control = image_accuracy(model, tok, n_images, seed=1, vision=self.config.vision, swap_images=True)
            metrics["evals"][-1].update(image=pictures, image_swapped=control)
            print(f"eval step {step}: held-out image questions {image_line(pictures, control)}", flush=True)


def text_batch(job: DemoJob, step: int, stage: Stage) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s text rows: `training.tasks.batch(seed, step)` with the run's data options."""
    args = job.args
    return batch(job.tok, args.seed, step, stage.batch, stage.length, drill_share=args.drill_share, world=job.worlds,
                 first_weight=args.first_weight, style=args.answer_style)


SPEC = trainer.TrainSpec(
    "demo_model", build_parser,
    model_config=lambda args, topk: DEMO_SIZES[args.size](topk, vision=args.image_every > 0),
    stages=lambda args: schedule(args.scale, args.stages), data=text_batch)


def main(argv: list[str] | None = None) -> int:
    args = SPEC.parse_args(argv)
    device = device_io.resolve_device(args.device)
    bf16 = device_io.uses_bf16(device, args.precision)
    device_io.prepare(device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    state_dir = args.state or args.out.with_name(args.out.name + ".state")
    state_dir.mkdir(parents=True, exist_ok=True)
    job = DemoJob(args, device, bf16)
    options = options_of(args)

    def same_run(info: dict) -> None:
        if info.get("seed") != args.seed or info.get("scale") != args.scale or info.get("topk") != args.topk:
            raise SystemExit(f"{state_dir} holds a run with seed {info.get('seed')}, scale {info.get('scale')}, "
                             f"topk {info.get('topk')}; pass the same settings or another --state")

    run_info = {"command": trainer.command_line("training.demo_model", argv), "seed": args.seed, "scale": args.scale,
                "topk": args.topk, "lr": args.lr, "indexer_lr": args.indexer_lr,
                "stages": [asdict(s) for s in job.stages], "commit": trainer.git_commit(), **options,
                **run_config.recorded(args)}
    if device.type != "cpu":
        run_info["hardware"] = device_io.describe(device, bf16)
    limits = trainer.Limits(job.total, args.save_every, args.eval_every, args.stop_after, args.time_limit)
    outcome, metrics = trainer.train(job, state_dir, run_info, limits, settings=options, defaults=OPTION_DEFAULTS,
                                     check=same_run)
    if outcome.reason == "stop-after":
        return 0
    if outcome.reason == "time-limit":   # the record and the card list the steps actually trained
        run_info = {**run_info, "stages": stages_done(run_info["stages"], outcome.step),
                    "planned_stages": run_info["stages"],
                    "stopped_early": f"step {outcome.step} of {job.total} (--time-limit {args.time_limit:.0f} s)"}
    job.distill.remove()
    if args.no_final:
        return 0
    return finalize(job.model, job.config, job.tok, args, state_dir, run_info, metrics)


def image_loss_step(model, tok: Tokenizer, distill: IndexerDistill, gen: torch.Generator, args, step: int,
                    phase: str, amp=None) -> tuple[float, torch.Tensor | None, int]:
    """Forward + backward of step `step`'s batch of image questions (gradients add to the text
    batch's): read densely in the dense phase, sparse in the sparse phase with the indexer learning
    its KL target on these rows too. Returns (its loss, its indexer KL (already backpropagated, for
    the log), its token count)."""
    ids, weights, images, mask = image_batch(tok, args.seed, step, args.image_batch, args.image_length,
                                             vision=model.config.vision, key_weight=key_weight_at(step))
    sparse = phase == "sparse"
    distill.active, distill.sparse = sparse, sparse
    distill.rows = query_rows(weights, 64, gen) if sparse else None
    device = model.lm_head.weight.device
    ids, weights = ids.to(device), weights.to(device)
    with amp if amp is not None else contextlib.nullcontext():
        loss, _ = weighted_loss(forward_with_images(model, ids, images, mask), ids, weights)
        kl = distill.take()
    (loss + (kl if kl is not None else 0.0)).backward()
    return float(loss.detach()), (kl.detach() if kl is not None else None), ids.numel()


def stages_done(stages: list[dict], step: int) -> list[dict]:
    """The stages (as `asdict(Stage)`) cut to the first `step` steps: what a run stopped early trained."""
    done, acc = [], 0
    for s in stages:
        n = min(s["steps"], max(0, step - acc))
        if n:
            done.append({**s, "steps": n})
        acc += s["steps"]
    return done


def finalize(model, config, tok: Tokenizer, args, state_dir: Path, run_info: dict, metrics: dict) -> int:
    """Quantize + write the checkpoint, reload it with the engine's loader, evaluate, write data files."""
    out, shipped = export_and_reload(model, config, args.out, {"loss.csv": state_dir / "loss.csv"})
    rows = held_out_needle(shipped, tok, args, style=run_info.get("answer_style", "key"))
    extra = {}
    if config.vision is not None:
        n_images = getattr(args, "image_eval", 96)
        extra["held_out_images"] = image_accuracy(shipped, tok, n_images, seed=7, vision=config.vision)
        extra["held_out_images_swapped"] = image_accuracy(shipped, tok, n_images, seed=7, vision=config.vision,
                                                          swap_images=True)
        print(f"held-out image questions: {image_line(extra['held_out_images'], extra['held_out_images_swapped'])}",
              flush=True)
    size = write_eval_files(out, config, run_info, rows, metrics["evals"], **extra)
    write_model_card(out, config, run_info, rows, size, sum(q.numel() for q in model.parameters()),
                     extra.get("held_out_images"), extra.get("held_out_images_swapped"))
    print(f"wrote {out} ({size / 2**20:.1f} MiB); held-out needle accuracy: {summary(rows)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
