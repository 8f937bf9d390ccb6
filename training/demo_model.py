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
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.tokenizer import Tokenizer
from training import device as device_io
from training import state as state_io
from training.distill import ExpertBalance, IndexerDistill, query_rows
from training.evaluate import needle_accuracy, summary
from training.image_tasks import forward_with_images, image_accuracy, image_batch
from training.model_card import image_line, write_model_card
from training.model_setup import DEMO_SIZES, export, trainable_model
from training.tasks import DRILL_SHARE, batch, key_weight_at
from training.wording import row_world
from workbench.retrieval_text import ANSWER_STYLES


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
    acc = 0
    for i, s in enumerate(stages):
        if step < acc + s.steps:
            return i, s
        acc += s.steps
    return len(stages) - 1, stages[-1]


def tokens_left(stages, step: int) -> int:
    """Training tokens still to come after `step` (stages with `steps`, `batch`, `length`): the ETA's numerator."""
    done, acc = 0, 0
    for s in stages:
        done += min(s.steps, max(0, step - acc)) * s.batch * s.length
        acc += s.steps
    return sum(s.steps * s.batch * s.length for s in stages) - done


def lr_at(step: int, total: int, peak: float, warmup: int = 40, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def weighted_loss(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Next-token cross-entropy weighted by `weights[:, t]` for predicting `ids[:, t + 1]`, and the
    mean loss on answer tokens (weight >= 0.99) as a float (NaN when the batch has none)."""
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    w = weights[:, :-1].flatten()
    answer = w >= 0.99
    answer_loss = float(ce.detach()[answer].mean()) if bool(answer.any()) else float("nan")
    return (ce * w).sum() / w.sum(), answer_loss


# Options added after the first shipped run; a state saved before them ran with these values.
OPTION_DEFAULTS = {"stage_spec": DEFAULT_STAGES, "varied_share": 0.0, "gaps": False, "drill_share": DRILL_SHARE,
                   "first_weight": None, "answer_style": "key", "image_every": 0, "image_batch": 8,
                   "image_length": 256, "tower_from": 0, "tower_lr_scale": 0.1, "size": "demo"}

LOSS_COLUMNS = ["step", "phase", "length", "loss", "answer_loss", "indexer_kl", "topk_mass", "lr", "tokens_per_s",
                "expert_max_load"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
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
    args = p.parse_args(argv)

    device = device_io.resolve_device(args.device)
    bf16 = device_io.uses_bf16(device, args.precision)
    device_io.prepare(device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    state_dir = args.state or args.out.with_name(args.out.name + ".state")
    state_dir.mkdir(parents=True, exist_ok=True)
    stages = schedule(args.scale, args.stages)
    options = {"stage_spec": args.stages, "varied_share": args.varied_share, "gaps": args.gaps,
               "drill_share": args.drill_share, "first_weight": args.first_weight, "answer_style": args.answer_style,
               "image_every": args.image_every, "image_batch": args.image_batch, "image_length": args.image_length,
               "tower_from": args.tower_from, "tower_lr_scale": args.tower_lr_scale, "size": args.size}
    total = sum(s.steps for s in stages)
    images_on = args.image_every > 0
    config = DEMO_SIZES[args.size](args.topk, vision=images_on)
    tok = Tokenizer.byte_level()
    model = trainable_model(config, args.seed).to(device)   # seeded on the CPU: the same init on every device
    model.runtime.kernels = "reference"   # the pure-torch ops everywhere: no Triton kernel in a graph that trains
    distill = IndexerDistill(model)
    balance = ExpertBalance(model)

    index_params = {n: q for n, q in model.named_parameters() if ".indexer." in n}
    bias = {n for n, _ in model.named_parameters() if n.endswith("e_score_correction_bias")}
    vision_params = {n: q for n, q in model.named_parameters() if n.startswith("vision.")}
    main_params = {n: q for n, q in model.named_parameters()
                   if n not in index_params and n not in bias and n not in vision_params}
    for n, q in model.named_parameters():
        if n in bias:
            q.requires_grad_(False)
    decay = [q for n, q in main_params.items() if q.dim() >= 2 and "embed" not in n]
    no_decay = [q for n, q in main_params.items() if not (q.dim() >= 2 and "embed" not in n)]
    opt_main = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                 lr=args.lr, betas=(0.9, 0.95))
    opt_index = torch.optim.AdamW(list(index_params.values()), lr=args.indexer_lr, betas=(0.9, 0.95), weight_decay=0.0)
    optimizers = {"main": opt_main, "indexer": opt_index}
    if vision_params:   # group 0: the projector at the main rate; group 1: the tower at tower_lr_scale of it
        tower = [q for n, q in vision_params.items() if n.startswith("vision.vision_tower.")]
        optimizers["vision"] = torch.optim.AdamW(
            [{"params": [q for n, q in vision_params.items() if not n.startswith("vision.vision_tower.")]},
             {"params": tower}], lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)

    step = 0
    metrics: dict = {"evals": []}
    resumed = state_io.latest(state_dir)
    if resumed is not None:
        info = state_io.load(resumed, model, optimizers)
        if info.get("seed") != args.seed or info.get("scale") != args.scale or info.get("topk") != args.topk:
            raise SystemExit(f"{state_dir} holds a run with seed {info.get('seed')}, scale {info.get('scale')}, "
                             f"topk {info.get('topk')}; pass the same settings or another --state")
        changed = {k: (info.get(k, OPTION_DEFAULTS[k]), v) for k, v in options.items()
                   if info.get(k, OPTION_DEFAULTS[k]) != v}
        if changed:
            raise SystemExit(f"{state_dir} holds a run with other settings {changed} (saved, given); "
                             "pass the same ones or another --state")
        step = int(info["step"])
        metrics = info.get("metrics", metrics)
        print(f"resumed from {resumed} at step {step}/{total}", flush=True)
    log, writer = state_io.open_loss_log(state_dir / "loss.csv", step,
                                         LOSS_COLUMNS + (["image_loss"] if images_on else []))
    run_info = {"command": "python -m training.demo_model " + " ".join(sys.argv[1:] if argv is None else argv), "seed": args.seed, "scale": args.scale, "topk": args.topk, "lr": args.lr,
                "indexer_lr": args.indexer_lr, "stages": [asdict(s) for s in stages], "commit": _git_commit(),
                **options}
    if device.type != "cpu":
        run_info["hardware"] = device_io.describe(device, bf16)
    # no draw at all when no row is reworded, so the first shipped run's batches are unchanged
    worlds = None if args.varied_share <= 0 else row_world(args.varied_share, args.gaps)

    dense_total = sum(s.steps for s in stages if s.phase != "warmup")
    interactive = sys.stderr.isatty()
    bar = tqdm(total=total, initial=step, desc="training", unit="step", file=sys.stderr, ascii=not interactive,
               mininterval=0.5 if interactive else 30, dynamic_ncols=interactive)
    gen = torch.Generator().manual_seed(args.seed)
    ema_tps = None
    last_image = float("nan")   # the log line shows the latest image batch's loss
    amp = device_io.autocast(device, bf16)
    started = time.perf_counter()
    while step < total:
        _, stage = stage_at(stages, step)
        t0 = time.perf_counter()
        ids, weights = batch(tok, args.seed, step, stage.batch, stage.length, drill_share=args.drill_share,
                             world=worlds, first_weight=args.first_weight, style=args.answer_style)
        gen.manual_seed(args.seed * 1_000_003 + step)
        warmup = stage.phase == "warmup"
        model.runtime.dsa_force_dense = stage.phase != "sparse"
        distill.active = stage.phase in ("warmup", "sparse")
        distill.sparse = stage.phase == "sparse"
        distill.rows = query_rows(weights, 64, gen) if distill.active else None
        ids, weights = ids.to(device), weights.to(device)
        for q in index_params.values():
            q.requires_grad_(distill.active)
        for q in main_params.values():
            q.requires_grad_(not warmup)
        image_step = images_on and not warmup and step % args.image_every == 0
        vision_on = image_step and step >= args.tower_from
        for q in vision_params.values():
            q.requires_grad_(vision_on)
        # the main schedule skips the warm-up steps: its cosine runs over dense + sparse steps
        main_step = sum(min(s.steps, max(0, step - sum(x.steps for x in stages[:i])))
                        for i, s in enumerate(stages) if s.phase != "warmup")
        lr = lr_at(main_step, dense_total, args.lr)
        for g in opt_main.param_groups:
            g["lr"] = lr
        for g in opt_index.param_groups:
            g["lr"] = args.indexer_lr
        if vision_params:
            opt_vision = optimizers["vision"]
            opt_vision.param_groups[0]["lr"], opt_vision.param_groups[1]["lr"] = lr, lr * args.tower_lr_scale
        loss_value = answer_value = float("nan")
        image_value = float("nan")
        n_tokens = ids.numel()
        if warmup:
            with torch.no_grad(), amp:
                model(ids)
            kl = distill.take()
            assert kl is not None
            kl.backward()
            torch.nn.utils.clip_grad_norm_(list(index_params.values()), 1.0)
            opt_index.step()
            opt_index.zero_grad(set_to_none=True)
        else:
            with amp:
                logits = model(ids)
                loss, answer_value = weighted_loss(logits, ids, weights)
                kl = distill.take()
            del logits
            total_loss = loss + (kl if kl is not None else 0.0)
            total_loss.backward()
            if image_step:
                image_value, image_kl, n_image = image_loss_step(model, tok, distill, gen, args, step, stage.phase,
                                                                 amp)
                kl = kl if image_kl is None else (image_kl if kl is None else kl + image_kl)
                last_image = image_value
                n_tokens += n_image
            torch.nn.utils.clip_grad_norm_(list(main_params.values()), 1.0)
            opt_main.step()
            opt_main.zero_grad(set_to_none=True)
            if vision_on:
                torch.nn.utils.clip_grad_norm_(list(vision_params.values()), 1.0)
                optimizers["vision"].step()
                optimizers["vision"].zero_grad(set_to_none=True)
            if kl is not None:
                torch.nn.utils.clip_grad_norm_(list(index_params.values()), 1.0)
                opt_index.step()
                opt_index.zero_grad(set_to_none=True)
            loss_value = float(loss.detach())
        max_load = balance.update()
        kl_value = float(kl.detach()) if kl is not None else float("nan")
        coverage = sum(distill.coverage) / len(distill.coverage) if distill.coverage else float("nan")
        distill.coverage = []
        dt = time.perf_counter() - t0
        tps = n_tokens / dt
        ema_tps = tps if ema_tps is None else 0.9 * ema_tps + 0.1 * tps
        writer.writerow([step, stage.phase, stage.length, f"{loss_value:.5f}", f"{answer_value:.5f}", f"{kl_value:.5f}",
                         f"{coverage:.4f}", f"{lr:.6f}", f"{tps:.1f}", f"{max_load:.2f}"]
                        + ([f"{image_value:.5f}"] if images_on else []))
        step += 1
        bar.set_postfix_str(f"{stage.phase} L={stage.length} loss {loss_value:.3f} ans {answer_value:.3f} "
                            f"kl {kl_value:.3f} {ema_tps:.0f} tok/s", refresh=False)
        bar.update(1)
        if step % 10 == 0 or step == total:
            log.flush()
            left = tokens_left(stages, step)
            print(f"step {step}/{total} {stage.phase} L={stage.length} loss {loss_value:.3f} answer {answer_value:.3f} "
                  f"kl {kl_value:.3f} topk-mass {coverage:.2f} lr {lr:.2e} "
                  + (f"image {last_image:.3f} " if images_on else "") + f"{ema_tps:.0f} tok/s "
                  f"ETA {left / max(ema_tps, 1) / 60:.0f} min", flush=True)
        if step % args.save_every == 0 or step == total or step == args.stop_after:
            state_io.save(state_dir, step, model, optimizers, {**run_info, "metrics": metrics})
        if step == args.stop_after:
            print(f"stopping after step {step} as asked (--stop-after); run again to resume", flush=True)
            return 0
        if args.time_limit is not None and time.perf_counter() - started > args.time_limit and step < total:
            state_io.save(state_dir, step, model, optimizers, {**run_info, "metrics": metrics})
            print(f"stopping at step {step}/{total}: --time-limit {args.time_limit:.0f} s reached; exporting what "
                  "is trained (run again to resume the schedule)", flush=True)
            # the record and the card list the steps actually trained
            run_info = {**run_info, "stages": stages_done(run_info["stages"], step), "planned_stages": run_info["stages"],
                        "stopped_early": f"step {step} of {total} (--time-limit {args.time_limit:.0f} s)"}
            break
        if step % args.eval_every == 0 or step == total:
            distill.active = False  # quick evals are plain forwards
            rows = needle_accuracy(model, tok, lengths=(stage.length,), depths=(0.1, 0.5, 0.9),
                                   samples=args.eval_samples_during, modes=("sparse", "dense"),
                                   style=args.answer_style)
            metrics["evals"].append({"step": step, "rows": rows})
            print(f"eval step {step} (held-out needle, in-memory fp32 model): {summary(rows)}", flush=True)
            if images_on:
                n_images = max(1, args.image_eval // 2)
                pictures = image_accuracy(model, tok, n_images, seed=1, vision=config.vision)
                control = image_accuracy(model, tok, n_images, seed=1, vision=config.vision, swap_images=True)
                metrics["evals"][-1].update(image=pictures, image_swapped=control)
                print(f"eval step {step}: held-out image questions {image_line(pictures, control)}", flush=True)
    bar.close()
    log.close()
    distill.remove()
    if args.no_final:
        return 0
    return finalize(model, config, tok, args, state_dir, run_info, metrics)


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


def export_and_reload(model, config, out: Path, losses: dict[str, Path]):
    """Quantize + write the checkpoint with its loss curves beside it; return (dir, the model reloaded by
    the engine's loader onto the device `model` trained on): every evaluation runs on what users run
    (MXFP4 experts)."""
    from engine import load_model

    out = export(model, config, out)
    for name, source in losses.items():
        shutil_copy(source, out / name)
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


def shutil_copy(src: Path, dst: Path) -> None:
    import shutil
    if src.exists():
        shutil.copyfile(src, dst)


if __name__ == "__main__":
    raise SystemExit(main())
