"""Train a larger demo model from scratch on one GPU inside a wall-clock budget, then export and judge it:
`training/gpu_train.sh` (or `python -m training.gpu_run --out ./out`).

What one run does, in `--budget-min` minutes (10 by default) counted from its start:
1. measures, on the machine it runs on, the tokens per second of one training step of every stage
   shape (a throwaway model of the same size, real forward + backward + optimizer step, image batches
   included), and the tokens per second of a chunked `Session` prefill (what the evaluation runs);
2. sizes every stage from those figures (`plan_stages`): the time left after the measured evaluation
   cost and the export is shared between the stages in the proportions of `GPU_PLAN` (dense ->
   indexer warm-up -> sparse -> longer sparse, the order of `training.demo_model`), so the schedule and
   its learning-rate cosine are planned for the steps that fit;
3. trains with `training.demo_model` (`--size gpu`: `model_setup.gpu_demo_config`), with the data
   options of the shipped demo (varied wording 0.7, gaps, recall drills 0.5, first value token x3,
   picture questions every second step), saving its state every `--save-every` steps; a training
   phase that runs past its share stops early and exports what it has (`--time-limit`);
4. exports the checkpoint (MXFP4 experts, the real layout, model card), reloads it with
   `engine.load_model` and runs the interval table (`training.interval_table`): in-world and
   held-out at 2K / 8K / 32K and in-world at 128K, 24 prompts a cell;
5. compares it with `builtin:demo`'s shipped table (`engine/builtin/demo/intervals.json`), pooled per
   world over the lengths both measured (`interval_table.compare`).

Written under `--out`: `checkpoint/` (config.json, safetensors, tokenizer, training.json,
MODEL_CARD.md, loss.csv, eval.json, intervals.json, INTERVALS.md), `state/` (resumable training
state), `plan.json` (the measured throughput and the planned stages), `intervals.json`,
`INTERVALS.md`, `COMPARISON.md` and `comparison.json`.

Interrupted? Run the same command again: the saved plan is reused (no new measurement) and training
resumes from the last saved step; a state that finished training is exported and evaluated again.

`--smoke` runs the same path at the demo's small size with a few steps and one-prompt cells, on any
device (the CPU test `tests/training/test_gpu_train_smoke.py`).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.tokenizer import Tokenizer
from training import device as device_io
from training import run_config
from training.demo_model import Stage, weighted_loss
from training.distill import IndexerDistill, query_rows
from training.image_tasks import forward_with_images, image_batch
from training.model_setup import DEMO_SIZES, trainable_model
from training.state import write_json_atomic
from training.tasks import batch
from training.wording import row_world

SHIPPED_TABLE = Path(__file__).resolve().parent.parent / "engine" / "builtin" / "demo" / "intervals.json"


@dataclass(frozen=True)
class StageShare:
    """A stage of the plan: its phase, its share of the training time and each step's batch shape."""
    phase: str
    share: float
    batch: int
    length: int

    @property
    def shape(self) -> tuple[str, int, int]:
        return self.phase, self.batch, self.length


# Shares of the training time, not of the steps: the longer stages cost more per token. The order is
# the demo run's; the longer sparse stages get more of the time than they did on the CPU because the
# shipped demo needed three continuations at 2K-16K to retrieve at 32K.
GPU_PLAN: tuple[StageShare, ...] = (
    StageShare("dense", 0.34, 32, 512),
    StageShare("dense", 0.12, 16, 1024),
    StageShare("warmup", 0.03, 16, 1024),
    StageShare("sparse", 0.12, 16, 1024),
    StageShare("sparse", 0.17, 8, 2048),
    StageShare("sparse", 0.13, 4, 4096),
    StageShare("sparse", 0.09, 2, 8192),
)
SMOKE_PLAN: tuple[StageShare, ...] = (
    StageShare("dense", 0.5, 2, 128),
    StageShare("warmup", 0.2, 1, 256),
    StageShare("sparse", 0.3, 1, 256),
)

GPU_CELLS = ("in-world:2048x24,held-out:2048x24,in-world:8192x24,held-out:8192x24,"
             "in-world:32768x24,held-out:32768x24,in-world:131072x24")
SMOKE_CELLS = "in-world:512x1,held-out:512x1"
# the training run's data options (the shipped demo's): a run configuration of `training.demo_model`
DEMO_CONFIG = Path(__file__).resolve().parent / "configs" / "gpu_demo.toml"
IMAGE_EVERY = 2   # as DEMO_CONFIG's image_every: the measurement adds an image batch's time every IMAGE_EVERY steps
IMAGE_BATCH = {False: 8, True: 2}   # image questions per image step: the GPU run's, the smoke run's
# the tower and projector keep their seeded init for this share of the steps (the shipped demo's run: 600 of 1460)
TOWER_SHARE = 0.4
EXPORT_SECONDS = 45.0  # writing, reloading and the model card's short needle evaluation, beyond the interval cells
PLAN_MARGIN = 0.92     # steps are planned for this share of the training time: per-step work the measurement
                       # leaves out (logging, expert balance, saves) must not push the run past --time-limit


def plan_stages(plan: Sequence[StageShare], tokens_per_s: Mapping[tuple[str, int, int], float], seconds: float, *,
                max_steps: int | None = None) -> list[Stage]:
    """Steps of every stage so that the stages take `seconds` together at the measured speeds.

    `tokens_per_s[stage.shape]`: training tokens per second of one step of that shape (image batches
    and optimizer steps included). Each stage gets `share * seconds` (the shares are normalised to
    sum to 1), at least one step, and at most `max_steps` when given (the smoke run's bound)."""
    total_share = sum(s.share for s in plan)
    if total_share <= 0 or seconds <= 0:
        raise ValueError(f"a plan needs positive shares and time (shares {total_share}, {seconds} s)")
    stages = []
    for s in plan:
        rate = tokens_per_s[s.shape]
        if not rate > 0:
            raise ValueError(f"no measured speed for stage {s.shape}")
        steps = max(1, math.floor(s.share / total_share * seconds * rate / (s.batch * s.length)))
        if max_steps is not None:
            steps = min(steps, max_steps)
        stages.append(Stage(s.phase, steps, s.batch, s.length))
    return stages


def stage_spec(stages: Sequence[Stage]) -> str:
    """`training.demo_model --stages` text of `stages`."""
    return ",".join(f"{s.phase}:{s.steps}x{s.batch}x{s.length}" for s in stages)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_training(size: str, plan: Sequence[StageShare], device: torch.device, bf16: bool, *, seed: int = 0,
                     steps: int = 2, untimed: int = 1, image_batch_size: int = 8, image_length: int = 256) -> dict:
    """Tokens per second of a training step of every shape in `plan` on `device`, measured on a
    throwaway model of `size` (forward, backward, clipping and an AdamW step; the first step of each
    shape is not timed (`untimed`): it allocates). Image batches, which `IMAGE_EVERY`th steps add, are timed apart
    and their share added to every non-warm-up step. Returns {"tokens_per_s": {shape: rate},
    "image_seconds": s, "step_seconds": {shape: s}} (shapes as "phase:batchxlength" keys in the JSON form)."""
    tok = Tokenizer.byte_level()
    model = trainable_model(DEMO_SIZES[size](64, vision=True), seed).to(device)
    model.runtime.kernels = "reference"
    distill = IndexerDistill(model)
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    amp = device_io.autocast(device, bf16)
    world = row_world(0.7, True)

    def one_step(phase: str, b: int, length: int, i: int) -> None:
        ids, weights = batch(tok, seed, 10_000_000 + i, b, length, drill_share=0.5, world=world, first_weight=3.0)
        model.runtime.dsa_force_dense = phase != "sparse"
        distill.active, distill.sparse = phase in ("warmup", "sparse"), phase == "sparse"
        distill.rows = query_rows(weights, 64, gen) if distill.active else None
        ids, weights = ids.to(device), weights.to(device)
        if phase == "warmup":
            with torch.no_grad(), amp:
                model(ids)
            distill.take().backward()
        else:
            with amp:
                loss, _ = weighted_loss(model(ids), ids, weights)
                kl = distill.take()
            (loss + (kl if kl is not None else 0.0)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def image_step(i: int) -> None:
        ids, weights, images, mask = image_batch(tok, seed, 10_000_000 + i, image_batch_size, image_length,
                                                 vision=model.config.vision)
        model.runtime.dsa_force_dense = True
        distill.active = False
        ids, weights = ids.to(device), weights.to(device)
        with amp:
            loss, _ = weighted_loss(forward_with_images(model, ids, images, mask), ids, weights)
        loss.backward()
        opt.zero_grad(set_to_none=True)

    def timed(fn) -> float:
        for i in range(untimed):
            fn(-1 - i)
        _sync(device)
        started = time.perf_counter()
        for i in range(steps):
            fn(i)
        _sync(device)
        return (time.perf_counter() - started) / steps

    image_seconds = timed(image_step)
    step_seconds, rates = {}, {}
    for s in plan:
        if s.shape in rates:
            continue
        sec = timed(lambda i, s=s: one_step(s.phase, s.batch, s.length, i))
        if s.phase != "warmup":
            sec += image_seconds / IMAGE_EVERY
        step_seconds[s.shape] = sec
        rates[s.shape] = s.batch * s.length / sec
    distill.remove()
    return {"tokens_per_s": rates, "image_seconds": image_seconds, "step_seconds": step_seconds}


def measure_prefill(size: str, device: torch.device, lengths: tuple[int, int], *, chunk: int = 4096, seed: int = 0,
                    repeats: int = 2) -> tuple[float, float]:
    """Seconds of a `Session` prefill (chunks of `chunk`) on a throwaway model of `size`, as
    `(a, b)` of `a * T + b * T**2`, fitted to the prefills at the two `lengths` (the last of `repeats`
    each: the first allocates). The square term is the indexer, which scores every earlier key."""
    from engine.session import Session

    tok = Tokenizer.byte_level()
    model = trainable_model(DEMO_SIZES[size](64, vision=False), seed).to(device).eval()
    seconds = []
    with torch.no_grad():
        for length in lengths:
            ids = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
            for _ in range(repeats):
                session = Session(model, tok, prefill_chunk=chunk, progress=False)
                session.append(ids=ids, name="prompt")
                _sync(device)
                started = time.perf_counter()
                session.prefill()
                _sync(device)
                took = time.perf_counter() - started
            seconds.append(took)
    return fit_prefill(lengths, seconds)


def fit_prefill(lengths: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """(a, b) >= 0 with a * T + b * T**2 through the two measured (length, seconds) points (b = 0
    when the longer prefill is not slower per token)."""
    (l1, l2), (t1, t2) = lengths, seconds
    b = max(0.0, (t2 / l2 - t1 / l1) / (l2 - l1))
    a = max(0.0, t2 / l2 - b * l2)
    return a, b


def eval_seconds(cells: Sequence, prefill: tuple[float, float]) -> float:
    """The interval cells' cost at the measured prefill speed `(a, b)` (`fit_prefill`): every prompt
    is prefilled once (the answer's few teacher-forced tokens are noise beside it)."""
    a, b = prefill
    return sum(c.prompts * (a * c.length + b * c.length ** 2) for c in cells)


def _shape_key(shape: tuple[str, int, int]) -> str:
    return f"{shape[0]}:{shape[1]}x{shape[2]}"


def make_plan(args, device: torch.device, bf16: bool, cells: Sequence, started: float, log=print) -> dict:
    """Measure, then size the stages to the time left (the plan written to `plan.json`)."""
    plan = SMOKE_PLAN if args.smoke else GPU_PLAN
    log(f"measuring training throughput on {device_io.describe(device, bf16)} ...")
    speeds = measure_training(args.size, plan, device, bf16, seed=args.seed, steps=1 if args.smoke else 2,
                              untimed=0 if args.smoke else 1, image_batch_size=IMAGE_BATCH[args.smoke])
    prefill = measure_prefill(args.size, device, (256, 512) if args.smoke else (4096, 16384),
                              repeats=1 if args.smoke else 2)
    evaluation = eval_seconds(cells, prefill)
    if args.evaluate_builtin:   # builtin:demo is smaller: its cells cost less than the new model's, never more
        evaluation *= 2
    budget = args.budget_min * 60
    spent = time.perf_counter() - started
    train = budget - spent - evaluation - (0 if args.smoke else EXPORT_SECONDS)
    if train < 0.3 * budget:
        log(f"warning: the evaluation is estimated at {evaluation:.0f} s of the {budget:.0f} s budget; training "
            f"gets {0.3 * budget:.0f} s anyway and the run will end late")
        train = 0.3 * budget
    stages = plan_stages(plan, speeds["tokens_per_s"], PLAN_MARGIN * train, max_steps=1 if args.smoke else None)
    total = sum(s.steps for s in stages)
    for s in plan:
        log(f"  {_shape_key(s.shape)}: {speeds['tokens_per_s'][s.shape]:,.0f} tokens/s")
    log(f"prefill 16K tokens in {prefill[0] * 16384 + prefill[1] * 16384 ** 2:.2f} s -> evaluation about "
        f"{evaluation:.0f} s; training {train:.0f} s: "
        f"{stage_spec(stages)} ({total} steps)")
    return {"device": device_io.describe(device, bf16), "budget_s": budget, "measure_s": round(spent, 1),
            "train_s": round(train, 1), "eval_estimate_s": round(evaluation, 1),
            "prefill_fit": {"a": prefill[0], "b": prefill[1]}, "image_step_s": round(speeds["image_seconds"], 4),
            "tokens_per_s": {_shape_key(k): round(v, 1) for k, v in speeds["tokens_per_s"].items()},
            "stages": [asdict(s) for s in stages], "stage_spec": stage_spec(stages),
            "tower_from": 0 if args.smoke else round(TOWER_SHARE * total), "size": args.size}


MAX_PLANNED_STEPS = 1_000_000


def read_plan(path: Path, size: str, shapes: Sequence[StageShare]) -> dict:
    """A saved `plan.json`, checked before anything is sized from it: its stages must be `shapes`'
    batch shapes in order (so no batch larger than the program's own is ever allocated) with 1 to
    MAX_PLANNED_STEPS steps each; anything else exits naming the file and the problem."""
    def bad(problem: str) -> SystemExit:
        return SystemExit(f"{path}: {problem}; remove it to measure and plan again, or pass another --out")

    try:
        plan = json.loads(path.read_text())
        stages = [Stage(**s) for s in plan["stages"]]
        floats = [float(plan[k]) for k in ("train_s", "measure_s")]
        tower_from = plan["tower_from"]
    except (ValueError, TypeError, KeyError) as exc:
        raise bad(f"not a plan this program wrote ({type(exc).__name__}: {exc})") from None
    if plan.get("size") != size:
        raise bad(f"it plans a {plan.get('size')}-size run, this one is {size}-size")
    if [(s.phase, s.batch, s.length) for s in stages] != [x.shape for x in shapes]:
        raise bad("its stages are not this program's stage shapes")
    if not all(isinstance(s.steps, int) and 1 <= s.steps <= MAX_PLANNED_STEPS for s in stages):
        raise bad(f"a stage's steps are outside 1..{MAX_PLANNED_STEPS:,}")
    if not (isinstance(tower_from, int) and 0 <= tower_from <= sum(s.steps for s in stages)) or min(floats) < 0:
        raise bad("tower_from or a time is out of range")
    plan["stage_spec"] = stage_spec(stages)   # rebuilt from the checked stages, never taken as written
    plan["train_s"], plan["measure_s"] = floats
    return plan


def write_comparison(out: Path, rows: list[dict], baseline: Path) -> dict:
    """COMPARISON.md and comparison.json: the new table against builtin:demo's shipped one, pooled per world."""
    from training.interval_table import compare

    problem, verdict = None, {}
    if not baseline.is_file():
        problem = f"No shipped interval table for builtin:demo at `{baseline}`"
    else:
        try:
            verdict = {"baseline": str(baseline), "available": True, **compare(rows, json.loads(baseline.read_text()))}
        except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:   # a table this run cannot read
            problem = f"builtin:demo's interval table `{baseline}` is unreadable ({type(exc).__name__}: {exc})"
    if problem is not None:
        verdict = {"baseline": str(baseline), "available": False, "problem": problem, "beats": False}
        text = (f"# Against builtin:demo\n\n{problem}: nothing to compare with.\n\n"
                "beats builtin:demo on both tables: no (no baseline table)\n")
    else:
        # the verdicts' definitions are compare's own, quoted so the file cannot drift from the code
        rule = " ".join(inspect.getdoc(compare).split("\n\n", 1)[-1].split())
        lines = ["# Against builtin:demo", "",
                 "Value right given the key, pooled per world over the lengths both tables measured, with 95% Wilson",
                 f"intervals (`training.interval_table.compare`). {rule}", "",
                 "| world | lengths | new model | 95% interval | builtin:demo | 95% interval | verdict |",
                 "|---|---|---:|---|---:|---|---|"]
        for world in ("in-world", "held-out"):
            v = verdict.get(world)
            if v is None:
                lines.append(f"| {world} | none in common | - | - | - | - | not compared |")
                continue
            (k, n, lo, hi), (bk, bn, blo, bhi) = v["new"], v["base"]
            word = "better" if v["better"] else ("not worse" if v["not_worse"] else "worse")
            lines.append(f"| {world} | {', '.join(f'{x:,}' for x in v['lengths'])} | {k}/{n} ({k / n:.0%}) | "
                         f"{lo:.0%}-{hi:.0%} | {bk}/{bn} ({bk / bn:.0%}) | {blo:.0%}-{bhi:.0%} | {word} |")
        lines += ["", f"beats builtin:demo on both tables: {'yes' if verdict['beats'] else 'no'}", ""]
        text = "\n".join(lines)
    (out / "comparison.json").write_text(json.dumps(verdict, indent=1) + "\n")
    (out / "COMPARISON.md").write_text(text)
    return verdict


def evaluate(out: Path, checkpoint: Path, device: torch.device, cells: Sequence, baseline: Path, *,
             evaluate_builtin: bool = False, log=print) -> dict:
    """The interval table of the written checkpoint (reloaded by the engine's loader) and the comparison
    with `baseline`, or with builtin:demo measured here on the same prompts when `evaluate_builtin`."""
    from engine import load_model
    from engine.runtime import RuntimeOptions
    from training.interval_table import markdown, run_cells

    def table(reference) -> list[dict]:
        # eager decode: the same function as the compiled step users get on CUDA, without compiling for
        # each of the many short sessions inside the time budget
        model = load_model(reference, device=device, runtime=RuntimeOptions(compile=False))
        return run_cells(model, Tokenizer.byte_level(), cells, log=log)

    rows = table(checkpoint)
    text = markdown(rows, f"Interval table: {checkpoint.name} ({out.resolve().name})")
    for d in (out, checkpoint):   # beside the checkpoint too, so shipping the directory ships its table
        (d / "intervals.json").write_text(json.dumps(rows, indent=1) + "\n")
        (d / "INTERVALS.md").write_text(text)
    if evaluate_builtin:
        log("the same cells on builtin:demo ...")
        baseline = out / "builtin-demo-intervals.json"
        base_rows = table("builtin:demo")
        baseline.write_text(json.dumps(base_rows, indent=1) + "\n")
        (out / "BUILTIN-DEMO-INTERVALS.md").write_text(markdown(base_rows, "Interval table: builtin:demo"))
    verdict = write_comparison(out, rows, baseline)
    log((out / "COMPARISON.md").read_text().strip().splitlines()[-1])
    return verdict


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("out"), help="where everything is written (default ./out)")
    p.add_argument("--budget-min", type=float, default=10.0,
                   help="wall-clock minutes for the whole run, evaluation included")
    p.add_argument("--device", choices=device_io.DEVICES, default="auto", help="auto: CUDA when visible")
    p.add_argument("--precision", choices=device_io.PRECISIONS, default="auto", help="auto: bf16 autocast on CUDA")
    p.add_argument("--smoke", action="store_true",
                   help="the demo's small size, a few steps, one-prompt cells, any device (the CI test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (the 6-layer demo trained at 3e-3)")
    p.add_argument("--cells", type=str, default=None, help="interval cells WORLD:LENGTHxPROMPTS,... (default: "
                   "2K/8K/32K both worlds and 128K in-world, 24 prompts each)")
    p.add_argument("--baseline", type=Path, default=SHIPPED_TABLE, help="builtin:demo's interval rows to compare with")
    p.add_argument("--evaluate-builtin", action="store_true",
                   help="also run the cells on builtin:demo here (same prompts) and compare with that instead of "
                        "--baseline; its time comes out of the training's share")
    p.add_argument("--save-every", type=int, default=None,
                   help="steps between saved training states (default: an eighth of the planned steps, at least "
                        "25: each save writes weights and moments with an fsync, time the plan does not include)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    return p


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = run_config.parse_args(build_parser(), argv, "gpu_run")
    args.size = "demo" if args.smoke else "gpu"

    from training import demo_model
    from training.interval_table import parse_cells

    device = device_io.resolve_device(args.device)
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("no CUDA device is visible: this run is sized for one GPU. Run it on a CUDA machine, or pass "
                         "--smoke (SMOKE=1 for gpu_train.sh) for the small CPU run that checks the path")
    if args.threads:
        torch.set_num_threads(args.threads)
    bf16 = device_io.uses_bf16(device, args.precision)
    device_io.prepare(device)
    try:
        cells = parse_cells(args.cells or (SMOKE_CELLS if args.smoke else GPU_CELLS))
    except ValueError as exc:
        raise SystemExit(f"--cells: {exc}") from None
    out, state = args.out, args.out / "state"
    state.mkdir(parents=True, exist_ok=True)
    plan_file = out / "plan.json"
    if plan_file.is_file():
        plan = read_plan(plan_file, args.size, SMOKE_PLAN if args.smoke else GPU_PLAN)
        print(f"resuming the plan in {plan_file}: {plan['stage_spec']}", flush=True)
    else:
        plan = make_plan(args, device, bf16, cells, started)
        write_json_atomic(plan_file, plan)
    train_left = max(1.0, plan["train_s"] - (time.perf_counter() - started - plan["measure_s"]))
    total_steps = sum(s["steps"] for s in plan["stages"])
    checkpoint = out / "checkpoint"
    train_args = ["--out", str(checkpoint), "--state", str(state), "--size", args.size, "--seed", str(args.seed),
                  "--device", device.type, "--precision", args.precision, "--lr", str(args.lr),
                  "--stages", plan["stage_spec"], "--config", str(DEMO_CONFIG), "--tower-from", str(plan["tower_from"]),
                  "--image-batch", str(IMAGE_BATCH[args.smoke]), "--image-eval", "4" if args.smoke else "96",
                  "--save-every", str(args.save_every or max(25, math.ceil(total_steps / 8))),
                  "--eval-every", "1000000000", "--eval-samples-during", "1",
                  "--time-limit", f"{train_left:.0f}",
                  "--eval-lengths", "512" if args.smoke else "2048,8192",
                  "--eval-samples", "1" if args.smoke else "4,2",
                  "--threads", str(args.threads or torch.get_num_threads())]
    print("python -m training.demo_model " + " ".join(train_args), flush=True)
    code = demo_model.main(train_args)
    if code:
        return code
    verdict = evaluate(out, checkpoint, device, cells, args.baseline, evaluate_builtin=args.evaluate_builtin)
    shutil.copyfile(plan_file, checkpoint / "plan.json")
    took = time.perf_counter() - started
    print(f"done in {took / 60:.1f} min (budget {args.budget_min:g}): {checkpoint}; "
          f"beats builtin:demo on both tables: {'yes' if verdict.get('beats') else 'no'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
