"""Continue a finished text run on longer documents and varied wording:
`python -m training.lengthen --base BASE_STATE --state S` (checkpoint in S/final); builtin:demo's
continuations: `--config training/configs/builtin_demo_{2,3,4}_*.toml`.

Why a run of its own: the base run (`training.demo_model`) retrieves in its own wording but far less
in the held-out wording, and the culprit is the needle sentence (training/README.md, "Why the
design: figures behind the training modules"). So this run
starts from the base run's last state (read only; fresh optimizer moments), gives most documents a
freshly drawn phrasing of their facts (`training.wording.varied_world`), raises the share of
recall drills, and stretches the documents 2K -> 4K -> 8K tokens, at a rate well below the base
peak. DSA is sparse throughout (as shipped), the indexer learning the head-summed dense attention
over its selected keys (KL, `training.distill`), as in the base run's sparse phase.

Position-offset augmentation (random start positions, so RoPE sees longer distances) is not done:
the engine's attention takes a start position only with a cache, and training through a cache
would need changes to the engine for training alone.

Seeded and resumable as `training.demo_model`: batches are pure functions of (seed, step) in a
stream the base run never used; the state (weights, optimizer moments, step) is saved every
`--save-every` steps; running the same command again continues. At the end the experts are
quantized, the checkpoint is written with the untrained vision tower attached (as `builtin:demo`
ships, `training.extend --scale 0`), reloaded with `engine.load_model` and evaluated on held-out
needle prompts (and on training-world ones at 2K, the generalisation gap).

`--image-every N` keeps pictures in the mix: the model carries the vision tower (the base's, or
its seeded init when the base has none), and every Nth step adds a batch of image questions
(`training.demo_model.image_loss_step`, read sparse as the text is); the projector trains at the
main rate, the tower at `--tower-lr-scale` of it. The written checkpoint then ships the trained
tower, and the evaluation adds held-out image questions beside the swapped-image control.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.tokenizer import Tokenizer
from engine.weights.load import parse_model_path
from training import state as state_io
from training import run_config, trainer
from training.demo_model import image_loss_step
from training.finish import export_and_reload, held_out_needle, write_eval_files
from training.trainer import StepResult, tokens_left, weighted_loss
from training.copy_targets import CopySupervision
from training.distill import ExpertBalance, IndexerDistill, query_rows
from training.evaluate import needle_accuracy, summary
from training.image_tasks import image_accuracy
from training.model_card import chain_loss_name, eval_table, image_line, run_chain, write_model_card
from training.model_setup import load_checkpoint_weights, trainable_model, trained_demo_config
from training.tasks import batch
from training.natural_text import mixed_world
from training.wording import row_world
from workbench.retrieval_text import ANSWER_STYLES, TRAIN

# Batches are `training.tasks.batch(step + STREAM)`: the base run used steps 0..1559 and
# `training.extend` 1_000_000 + step, so no batch of either is repeated.
STREAM = 2_000_000


@dataclass(frozen=True)
class Stage:
    steps: int
    batch: int
    length: int


DEFAULT_STAGES = "120x2x2048,110x1x4096,80x1x8192"
# what a run saved before these options existed ran with
OPTION_DEFAULTS = {"stage_spec": DEFAULT_STAGES, "stream": STREAM, "gaps": False, "first_weight": None,
                   "answer_style": "key", "close_weight": None, "copy_weight": None,
                   "copy_heads": "mixture", "copy_first_only": False, "image_every": 0, "image_batch": 8,
                   "image_length": 256, "tower_lr_scale": 0.1, "natural_share": 0.0, "chat_share": 0.5}


def parse_stages(text: str) -> list[Stage]:
    """`STEPSxBATCHxLENGTH,...` -> stages (a clear error for anything else)."""
    stages = []
    for part in text.split(","):
        try:
            steps, size, length = (int(x) for x in part.strip().split("x"))
        except ValueError:
            raise SystemExit(f"--stages: {part!r} is not STEPSxBATCHxLENGTH (e.g. 120x2x2048)") from None
        if min(steps, size, length) < 1:
            raise SystemExit(f"--stages: {part!r} has a value below 1")
        stages.append(Stage(steps, size, length))
    return stages


def schedule(scale: float, stages: str = DEFAULT_STAGES) -> list[Stage]:
    """About 40 minutes on one CPU core at scale 1 with the default stages (4-8K tokens per step,
    ~800 tokens/s), evaluations aside."""
    base = parse_stages(stages)
    return [Stage(max(1, round(s.steps * scale)), s.batch, s.length) for s in base]


def stage_at(stages: list[Stage], step: int) -> Stage:
    return stages[trainer.stage_index((s.steps for s in stages), step)]


LR_WARMUP, LR_FLOOR = 20, 0.25   # the rate's warm-up steps and its floor (a share of --lr) at the end


def is_checkpoint(base: Path) -> bool:
    """A written checkpoint (`builtin:NAME` or a directory with config.json), not a training state."""
    return str(base).startswith("builtin:") or (base / "config.json").exists()


def base_settings(base: Path) -> tuple[int, int]:
    """(seed, topk) of the base: a training state's, or a checkpoint's training.json (seed 0 and its
    config's top-k when it has none)."""
    if not is_checkpoint(base):
        _, seed, topk = state_io.base_settings(base)
        return seed, topk
    config, root = parse_model_path(str(base))
    info_file = Path(root) / "training.json"
    info = json.loads(info_file.read_text()) if info_file.exists() else {}
    return int(info.get("seed", 0)), int(info.get("topk", config.dsa.topk))


def base_has_tower(base: Path) -> bool:
    """Whether the base's weights include a vision tower (a written checkpoint's is left out: untrained)."""
    if is_checkpoint(base):
        return False
    d = state_io.latest(base)
    if d is None:
        return False
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return any(k.startswith("vision.") for k in f.keys())


def load_base(base_dir: Path, model: torch.nn.Module) -> dict:
    """The base's weights into `model` (every tensor, shapes checked; the base is only read): the
    last step of a training state, or a written checkpoint (MXFP4 experts dequantized; how the
    continuation of the shipped `builtin:demo` starts once the state that made it is gone)."""
    if is_checkpoint(base_dir):
        info = load_checkpoint_weights(model, base_dir)
        seed, topk = base_settings(base_dir)
        return {"base_dir": str(base_dir), "base_step": 0, "base_commit": info.get("commit", ""),
                "base_command": info.get("command", ""), "checkpoint": True, "seed": seed, "topk": topk}
    d = state_io.latest(base_dir)
    if d is None:
        raise SystemExit(f"{base_dir}: no saved step (no latest.json): train the base model first")
    info = state_io.load(d, model, {})
    return {"base_dir": str(d), "base_step": int(info["step"]), "base_commit": info.get("commit", ""),
            "base_command": info.get("command", ""), "seed": int(info["seed"]), "topk": int(info["topk"])}


def with_tower(model: torch.nn.Module, topk: int, seed: int) -> tuple[torch.nn.Module, object]:
    """The text model with the vision tower's seeded init attached, as `builtin:demo` ships it."""
    config = trained_demo_config(topk, vision=True)
    full = trainable_model(config, seed)
    missing, unexpected = full.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("vision.") for k in missing), (missing[:3], unexpected[:3])
    full.eval()
    return full, config


COLUMNS = ["step", "length", "loss", "answer_loss", "indexer_kl", "topk_mass", "lr", "tokens_per_s"]
COPY_COLUMNS = ["copy_loss", "copy_mass"]   # runs with --copy-weight


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True,
                   help="the finished base run's state directory, or a written checkpoint (builtin:demo, a "
                        "directory with config.json); read only")
    p.add_argument("--state", type=Path, required=True, help="this run's resumable state directory")
    p.add_argument("--out", type=Path, default=None, help="final checkpoint directory (default STATE/final)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every stage's steps (0.01 = smoke test)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=8e-4, help="peak rate (the base run peaked at 3e-3, ended at 3e-4)")
    p.add_argument("--indexer-lr", type=float, default=1e-3)
    p.add_argument("--varied-share", type=float, default=0.7, help="rows with a freshly drawn fact wording")
    p.add_argument("--drill-share", type=float, default=0.5, help="rows that are recall drills (base run: 0.4)")
    p.add_argument("--stages", type=str, default=DEFAULT_STAGES, help="STEPSxBATCHxLENGTH,... (before --scale)")
    p.add_argument("--stream", type=int, default=STREAM,
                   help="batches are training.tasks.batch(stream + step); give another run another stream")
    p.add_argument("--gaps", action="store_true",
                   help="varied wording puts made-up words and symbols between key and value (wording.gap_link)")
    p.add_argument("--first-weight", type=float, default=None,
                   help="loss weight of each answer's first value token (default: as the rest of the value)")
    p.add_argument("--close-weight", type=float, default=None,
                   help="loss weight of the <|close|> after each answer (default: as the scaffold, 0.3)")
    p.add_argument("--answer-style", choices=ANSWER_STYLES, default="key",
                   help="answers as `key: value`, or the document quoted from the key through the value "
                        "(workbench.retrieval_text.answer_parts); recorded in training.json")
    p.add_argument("--copy-weight", type=float, default=None,
                   help="weight of the copy-attention targets (training.copy_targets): the last DSA layer's "
                        "attention from a copied token's row to the token it copies (default: off)")
    p.add_argument("--copy-heads", choices=("mixture", "best"), default="mixture",
                   help="copy targets push the heads' mean attention (mixture) or only the most attending head's")
    p.add_argument("--copy-first-only", action="store_true",
                   help="copy targets only for the first token of each copied run (the jump), not the rest")
    p.add_argument("--image-every", type=int, default=0,
                   help="every Nth step also trains on a batch of image questions (the model carries the vision "
                        "tower: the base's, or its seeded init); 0: text only")
    p.add_argument("--image-batch", type=int, default=8, help="image questions per image batch")
    p.add_argument("--image-length", type=int, default=256, help="tokens per image-question row")
    p.add_argument("--tower-lr-scale", type=float, default=0.1, help="the tower's rate as a share of the main rate")
    p.add_argument("--natural-share", type=float, default=0.0,
                   help="rows whose filler is natural English text, their facts worded afresh or as in chat "
                        "(training.natural_text); 0: none")
    p.add_argument("--chat-share", type=float, default=0.5,
                   help="of the natural rows, those whose needles are told and asked as a chat user would")
    p.add_argument("--loss-name", type=str, default="loss_lengthen.csv",
                   help="this run's loss curve's file name beside the checkpoint")
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=60)
    p.add_argument("--eval-during", type=str, default="2048,8192", help="held-out lengths of the quick evals")
    p.add_argument("--eval-samples-during", type=int, default=2, help="held-out prompts per depth in quick evals")
    p.add_argument("--eval-lengths", type=str, default="2048,8192,32768")
    p.add_argument("--eval-samples", type=str, default="8,4,2")
    p.add_argument("--stop-after", type=int, default=None, help="save and exit after this step (tests resuming)")
    p.add_argument("--no-final", action="store_true")
    return p


def settings_of(args: argparse.Namespace) -> dict:
    """The settings a resumed run must share with the state it resumes ("stage_spec": run_info's "stages"
    holds the parsed stages)."""
    return {"scale": args.scale, "lr": args.lr, "indexer_lr": args.indexer_lr, "varied_share": args.varied_share,
            "drill_share": args.drill_share, "stage_spec": args.stages, "stream": args.stream, "gaps": args.gaps,
            "first_weight": args.first_weight, "answer_style": args.answer_style, "close_weight": args.close_weight,
            "copy_weight": args.copy_weight, "copy_heads": args.copy_heads, "copy_first_only": args.copy_first_only,
            "image_every": args.image_every, "image_batch": args.image_batch, "image_length": args.image_length,
            "tower_lr_scale": args.tower_lr_scale, "natural_share": args.natural_share, "chat_share": args.chat_share}


class LengthenJob:
    """The continuation: text batches `training.tasks.batch(seed, stream + step)` read sparse, the indexer
    on its KL target, optional copy-attention targets, and picture questions every `image_every`th step."""

    name = "lengthen"

    def __init__(self, args: argparse.Namespace, seed: int, topk: int) -> None:
        self.args, self.seed, self.topk = args, seed, topk
        self.stages = SPEC.stages(args)
        self.total = sum(s.steps for s in self.stages)
        self.tok = Tokenizer.byte_level()
        self.images_on = args.image_every > 0
        self.config = SPEC.model_config(args, topk)
        self.model = trainable_model(self.config, seed)
        self.distill = IndexerDistill(self.model)
        self.copier = (CopySupervision(self.model, heads=args.copy_heads, first_only=args.copy_first_only)
                       if args.copy_weight else None)
        self.balance = ExpertBalance(self.model)
        self.params = trainer.LanguageModelParams.of(self.model)
        self.optimizers = self.params.optimizers(args.lr, args.indexer_lr)
        self.columns = COLUMNS + (COPY_COLUMNS if self.copier else []) + (["image_loss"] if self.images_on else [])
        self.gen = torch.Generator()
        self.worlds = None
        self.during = [int(x) for x in args.eval_during.split(",") if x]
        self.last_image = float("nan")   # the log line shows the latest image batch's loss

    def start(self, resumed: dict | None, run_info: dict) -> None:
        args = self.args
        if resumed is not None:
            run_info["base"] = resumed["base"]
        elif self.images_on and not base_has_tower(args.base):
            text = trainable_model(trained_demo_config(self.topk), self.seed)
            run_info["base"] = load_base(args.base, text)
            missing, unexpected = self.model.load_state_dict(text.state_dict(), strict=False)
            assert not unexpected and all(k.startswith("vision.") for k in missing), (missing[:3], unexpected[:3])
            del text
            print(f"starting from {run_info['base']['base_dir']} (base step {run_info['base']['base_step']}), "
                  "the vision tower at its seeded init", flush=True)
        else:
            run_info["base"] = load_base(args.base, self.model)
            print(f"starting from {run_info['base']['base_dir']} (base step {run_info['base']['base_step']})",
                  flush=True)
        run_info.update(seed=self.seed, topk=self.topk, answer_style=args.answer_style)
        self.worlds = (mixed_world(args.varied_share, args.natural_share, args.gaps, args.chat_share)
                       if args.natural_share else row_world(args.varied_share, args.gaps))
        self.model.runtime.dsa_force_dense = False

    def train_step(self, step: int) -> StepResult:
        args, model, distill, copier, gen = self.args, self.model, self.distill, self.copier, self.gen
        opt = self.optimizers
        stage = stage_at(self.stages, step)
        scale = trainer.warmup_cosine(step, self.total, LR_WARMUP, LR_FLOOR)
        for g in opt["main"].param_groups:
            g["lr"] = args.lr * scale
        if self.params.vision:
            opt["vision"].param_groups[0]["lr"] = args.lr * scale
            opt["vision"].param_groups[1]["lr"] = args.lr * scale * args.tower_lr_scale
        ids, weights, pairs = SPEC.data(self, step, stage)
        gen.manual_seed(self.seed * 1_000_003 + args.stream + step)
        distill.active, distill.sparse = True, True
        distill.rows = query_rows(weights, 64, gen)
        if copier is not None:
            copier.active, copier.pairs = True, pairs
        loss, answer = weighted_loss(model(ids), ids, weights)
        kl = distill.take()
        copy_loss, copy_mass = copier.take() if copier is not None else (None, float("nan"))
        if copier is not None:   # picture rows hold no copy pairs: nothing of their forward may reach the next step
            copier.active = False
        total_loss = loss + (kl if kl is not None else 0.0)
        if copy_loss is not None:
            total_loss = total_loss + args.copy_weight * copy_loss
        total_loss.backward()
        image_value, n_tokens = float("nan"), ids.numel()
        if self.images_on and step % args.image_every == 0:
            image_value, image_kl, n_image = image_loss_step(model, self.tok, distill, gen, args, args.stream + step,
                                                             "sparse")
            kl = kl if image_kl is None else (image_kl if kl is None else kl.detach() + image_kl)
            self.last_image, n_tokens = image_value, n_tokens + n_image
        distill.active = False
        trainer.clipped_step(self.params.main.values(), opt["main"])
        if self.params.vision:
            trainer.clipped_step(self.params.vision.values(), opt["vision"])
        if kl is not None:
            torch.nn.utils.clip_grad_norm_(list(self.params.indexer.values()), 1.0)
            opt["indexer"].step()
        opt["indexer"].zero_grad(set_to_none=True)
        self.balance.update()
        coverage = sum(distill.coverage) / len(distill.coverage) if distill.coverage else float("nan")
        distill.coverage = []
        loss_value = float(loss.detach())
        kl_value = float(kl.detach()) if kl is not None else float("nan")
        copy_value = float(copy_loss.detach()) if copy_loss is not None else float("nan")
        row = ([step, stage.length, f"{loss_value:.5f}", f"{answer:.5f}", f"{kl_value:.5f}", f"{coverage:.4f}",
                f"{args.lr * scale:.6f}"] + ([f"{copy_value:.5f}", f"{copy_mass:.4f}"] if copier else [])
               + ([f"{image_value:.5f}"] if self.images_on else []))

        def describe(ema: float, done: int) -> tuple[str, str]:
            head = f"L={stage.length} loss {loss_value:.3f} "
            return (head + f"ans {answer:.3f} kl {kl_value:.3f} {ema:.0f} tok/s",
                    head + f"answer {answer:.3f} kl {kl_value:.3f} topk-mass {coverage:.2f} "
                    + (f"copy {copy_value:.3f} mass {copy_mass:.2f} " if copier else "")
                    + (f"image {self.last_image:.3f} " if self.images_on else "") + f"lr {args.lr * scale:.2e} "
                    f"{ema:.0f} tok/s ETA {tokens_left(self.stages, done) / max(ema, 1) / 60:.0f} min")
        return StepResult(row, n_tokens, describe)

    def quick_eval(self, step: int, metrics: dict) -> None:
        if not self.during:
            return
        args, model, tok = self.args, self.model, self.tok
        rows = needle_accuracy(model, tok, lengths=self.during, samples=args.eval_samples_during, modes=("sparse",),
                               style=args.answer_style)
        metrics["evals"].append({"step": step, "rows": rows})
        print(f"eval step {step} (held-out needle, value (whole response), fp32): {summary(rows)}", flush=True)
        if self.images_on:
            pictures = image_accuracy(model, tok, 48, seed=1, vision=self.config.vision)
            control = image_accuracy(model, tok, 48, seed=1, vision=self.config.vision, swap_images=True)
            metrics["evals"][-1].update(image=pictures, image_swapped=control)
            print(f"eval step {step}: held-out image questions {image_line(pictures, control)}", flush=True)

    def remove_hooks(self) -> None:
        self.distill.remove()
        if self.copier is not None:
            self.copier.remove()


def text_batch(job: LengthenJob, step: int, stage: Stage) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Step `step`'s text rows, `training.tasks.batch(seed, stream + step)`, with the copy pairs they hold."""
    args = job.args
    return batch(job.tok, job.seed, args.stream + step, stage.batch, stage.length, drill_share=args.drill_share,
                 world=job.worlds, first_weight=args.first_weight, style=args.answer_style,
                 close_weight=args.close_weight, copies=True)


SPEC = trainer.TrainSpec(
    "lengthen", build_parser, model_config=lambda args, topk: trained_demo_config(topk, vision=args.image_every > 0),
    stages=lambda args: schedule(args.scale, args.stages), data=text_batch)


def main(argv: list[str] | None = None) -> int:
    args = SPEC.parse_args(argv)
    out = args.out or args.state / "final"
    torch.set_num_threads(args.threads)
    args.state.mkdir(parents=True, exist_ok=True)
    seed, topk = base_settings(args.base)
    args.seed = seed  # image batches are drawn from (seed, step) as in training.demo_model
    job = LengthenJob(args, seed, topk)
    settings = settings_of(args)
    run_info = {"command": trainer.command_line("training.lengthen", argv), **settings,
                "stages": [asdict(s) for s in job.stages], "commit": trainer.git_commit(), **run_config.recorded(args)}
    limits = trainer.Limits(job.total, args.save_every, args.eval_every, args.stop_after, eval_before_save=True)
    outcome, metrics = trainer.train(job, args.state, run_info, limits, settings=settings, defaults=OPTION_DEFAULTS)
    if outcome.reason == "stop-after":
        return 0
    job.remove_hooks()
    if args.no_final:
        return 0
    return finalize(job.model, job.tok, args, out, run_info, metrics)


def finalize(model, tok: Tokenizer, args, out: Path, run_info: dict, metrics: dict) -> int:
    """Quantize + write the checkpoint (with the trained tower of a run with image questions, else the
    untrained one attached), reload it with the engine's loader, evaluate held-out needles (and
    training-world ones at 2K; image questions beside the swapped-image control when trained), write
    the data files."""
    if model.config.vision is not None:  # trained with dense experts: written with MXFP4 ones, as shipped
        full, config = model, model.config.replace(expert_format="mxfp4")
    else:
        full, config = with_tower(model, run_info["topk"], run_info["seed"])
    # the runs behind these weights: from the exported step (`training.export_state`), else the run's last
    chain = run_chain(Path(run_info["exported_from"]) if "exported_from" in run_info else state_io.latest(args.state))
    losses = {args.loss_name: args.state / "loss.csv"}
    if len(chain) > 1 and not run_info["base"].get("checkpoint"):   # every run's curve, named by its state
        losses = {chain_loss_name(info): Path(info["step_dir"]).parent / "loss.csv" for info in chain}
    elif run_info["base"].get("checkpoint"):   # carry the base checkpoint's curves (loss.csv, loss_lengthen.csv, ...)
        from engine.builtin import model_dir
        for f in sorted(Path(model_dir(run_info["base"]["base_dir"])).glob("loss*.csv")):
            if f.name == args.loss_name:
                raise SystemExit(f"--loss-name {args.loss_name} is the name of the base's curve {f}: pick another")
            losses[f.name] = f
    else:
        losses["loss.csv"] = Path(run_info["base"]["base_dir"]).parent / "loss.csv"
    out, shipped = export_and_reload(full, config, out, losses)
    rows = held_out_needle(shipped, tok, args, style=args.answer_style)
    train_rows = needle_accuracy(shipped, tok, lengths=(2048,), samples=8, modes=("sparse",), world=TRAIN, seed=99,
                                 style=args.answer_style)
    extra = {}
    if model.config.vision is not None:
        extra["held_out_images"] = image_accuracy(shipped, tok, 96, seed=7, vision=config.vision)
        extra["held_out_images_swapped"] = image_accuracy(shipped, tok, 96, seed=7, vision=config.vision,
                                                          swap_images=True)
        print(f"held-out image questions: {image_line(extra['held_out_images'], extra['held_out_images_swapped'])}",
              flush=True)
    size = write_eval_files(out, config, run_info, rows, metrics["evals"], training_world_needle=train_rows, **extra)
    write_model_card(out, config, run_info, rows, size, sum(q.numel() for q in full.parameters()),
                     extra.get("held_out_images"), extra.get("held_out_images_swapped"), chain=chain,
                     untrained_tower=model.config.vision is None)
    (out / "EVAL.md").write_text(
        "# Measured on the written checkpoint (MXFP4 experts, loaded with engine.load_model)\n\n"
        "## Held-out needle retrieval (value given the key / prompts, whole response in brackets)\n\n"
        f"{eval_table(rows)}\n\n## Training-world needle prompts (the generalisation gap)\n\n{eval_table(train_rows)}\n")
    print(f"wrote {out} ({size / 2**20:.1f} MiB); held-out needle: {summary(rows)}; training world: "
          f"{summary(train_rows)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
