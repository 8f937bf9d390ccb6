"""The training loop every job shares: `training.demo_model`, `training.lengthen`, `training.extend` (and
`training.gpu_run`, which runs `training.demo_model`).

A job (`Job`) owns what differs between runs: its model and optimizers, its data stream and how one step
trains on it, its quick evaluation. `run` owns what they have in common: the loss log (one row per step,
truncated to the resumed step), the progress bar and a line every `LOG_EVERY` steps, the crash-safe state
saves (`training.state`) every `save_every` steps and at the end, `--stop-after`, `--time-limit` and the
quick evaluations. `resume` restores a saved state and refuses one saved with other settings. The
optimizer helpers build the AdamW groups the jobs share, in the parameter order the saved runs used
(gradient clipping sums over that order, so it is part of the computation).
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from tqdm import tqdm

from training import state as state_io

@dataclass(frozen=True)
class TrainSpec:
    """A job kind (torchtitan's `TrainSpec`, in small): the parts of a run its settings choose. Its entry
    point is `python -m training.KIND`; a run configuration (`training.run_config`) names it in `kind`."""
    kind: str
    build_parser: Callable[[], argparse.ArgumentParser]   # the options, so the keys of a run configuration
    model_config: Callable[[argparse.Namespace, int], object]   # (settings, DSA top-k) -> the ModelConfig it trains
    stages: Callable[[argparse.Namespace], list]   # (settings) -> its schedule
    data: Callable[..., tuple]   # (job, step, stage) -> the text batch of a step: a pure function of (seed, step)

    def parse_args(self, argv: list[str] | None) -> argparse.Namespace:
        """The command line over the defaults of the run configuration `--config` names, if any."""
        from training import run_config

        return run_config.parse_args(self.build_parser(), argv, self.kind)


LOG_EVERY = 10   # steps between the printed progress lines (and loss-log flushes)
BETAS = (0.9, 0.95)


@dataclass
class StepResult:
    """What one training step reports: its loss-log row without the tokens/s column (the trainer times
    the step and inserts it), the tokens it trained on, and `describe(tokens_per_s, steps_done)` ->
    (progress-bar postfix, the printed line after `step N/TOTAL`)."""
    row: list
    tokens: int
    describe: Callable[[float, int], tuple[str, str]]


class Job(Protocol):
    name: str              # the progress bar's label
    columns: list[str]     # the loss log's header; must hold "tokens_per_s"
    total: int             # steps in its schedule
    model: torch.nn.Module
    optimizers: dict[str, torch.optim.Optimizer]

    def start(self, resumed: dict | None, run_info: dict) -> None:
        """Before the first step of this process: a fresh run loads its base (`resumed` None), a resumed one
        takes what its state.json records; either adds to `run_info` (saved with every state)."""

    def train_step(self, step: int) -> StepResult: ...

    def quick_eval(self, step: int, metrics: dict) -> None: ...


@dataclass(frozen=True)
class Limits:
    """When the loop saves, evaluates and stops."""
    total: int                        # steps in the schedule
    save_every: int
    eval_every: int
    stop_after: int | None = None     # save and return after this step (tests resuming)
    time_limit: float | None = None   # seconds of training after which the run saves and stops
    eval_before_save: bool = False    # the saved state carries the evaluation of its own step


@dataclass(frozen=True)
class Outcome:
    step: int
    reason: str   # "done" | "stop-after" | "time-limit"


def run(job: Job, model: torch.nn.Module, optimizers: dict[str, torch.optim.Optimizer], state_dir: Path,
        run_info: dict, metrics: dict, step: int, limits: Limits) -> Outcome:
    """Train `job` from `step` to `limits.total` (see the module docstring); returns where and why it stopped."""
    log, writer = state_io.open_loss_log(state_dir / "loss.csv", step, job.columns)
    tps_at = job.columns.index("tokens_per_s")
    interactive = sys.stderr.isatty()
    bar = tqdm(total=limits.total, initial=step, desc=job.name, unit="step", file=sys.stderr,
               ascii=not interactive, mininterval=0.5 if interactive else 30, dynamic_ncols=interactive)

    def save() -> None:
        state_io.save(state_dir, step, model, optimizers, {**run_info, "metrics": metrics})

    ema = None
    started = time.perf_counter()
    try:
        while step < limits.total:
            t0 = time.perf_counter()
            result = job.train_step(step)
            tps = result.tokens / (time.perf_counter() - t0)
            ema = tps if ema is None else 0.9 * ema + 0.1 * tps
            writer.writerow(result.row[:tps_at] + [f"{tps:.1f}"] + result.row[tps_at:])
            step += 1
            postfix, line = result.describe(ema, step)
            bar.set_postfix_str(postfix, refresh=False)
            bar.update(1)
            if step % LOG_EVERY == 0 or step == limits.total:
                log.flush()
                print(f"step {step}/{limits.total} {line}", flush=True)
            eval_due = step % limits.eval_every == 0 or step == limits.total
            if eval_due and limits.eval_before_save:
                job.quick_eval(step, metrics)
            if step % limits.save_every == 0 or step == limits.total or step == limits.stop_after:
                save()
            if step == limits.stop_after:
                print(f"stopping after step {step} as asked (--stop-after); run again to resume", flush=True)
                return Outcome(step, "stop-after")
            if (limits.time_limit is not None and time.perf_counter() - started > limits.time_limit
                    and step < limits.total):
                save()
                print(f"stopping at step {step}/{limits.total}: --time-limit {limits.time_limit:.0f} s reached; "
                      "exporting what is trained (run again to resume the schedule)", flush=True)
                return Outcome(step, "time-limit")
            if eval_due and not limits.eval_before_save:
                job.quick_eval(step, metrics)
        return Outcome(step, "done")
    finally:
        bar.close()
        log.close()


def train(job: Job, state_dir: Path, run_info: dict, limits: Limits, *, settings: Mapping | None = None,
          defaults: Mapping | None = None, check: Callable[[dict], None] | None = None) -> tuple[Outcome, dict]:
    """Resume `job` from `state_dir` (`resume`: its `settings` must match, `check` may refuse the state) or
    start it afresh, then train (`run`): (where it stopped, the metrics of its quick evaluations)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    step, metrics, info = 0, {"evals": []}, None
    resumed = resume(state_dir, job.model, job.optimizers, settings or {}, defaults or {}, job.total, check=check)
    if resumed is not None:
        step, metrics, info = resumed
    job.start(info, run_info)
    return run(job, job.model, job.optimizers, state_dir, run_info, metrics, step, limits), metrics


def resume(state_dir: Path, model: torch.nn.Module, optimizers: dict[str, torch.optim.Optimizer],
           settings: Mapping, defaults: Mapping, total: int,
           check: Callable[[dict], None] | None = None) -> tuple[int, dict, dict] | None:
    """Restore the last saved state of `state_dir` into `model` and `optimizers`: (step, metrics, its
    state.json), or None for a fresh run. `check(state.json)` may refuse it first; a state saved with
    other `settings` (a setting it lacks ran with its value in `defaults`: the option did not exist yet)
    exits naming them."""
    resumed = state_io.latest(state_dir)
    if resumed is None:
        return None
    info = state_io.load(resumed, model, optimizers)
    if check is not None:
        check(info)
    changed = {k: (info.get(k, defaults.get(k)), v) for k, v in settings.items() if info.get(k, defaults.get(k)) != v}
    if changed:
        raise SystemExit(f"{state_dir} holds a run with other settings {changed} (saved, given); "
                         "pass the same ones or another --state")
    step = int(info["step"])
    print(f"resumed from {resumed} at step {step}/{total}", flush=True)
    return step, info.get("metrics", {"evals": []}), info


def decays(name: str, param: torch.Tensor) -> bool:
    """Weight decay applies to matrices, never to embeddings, norms or biases."""
    return param.dim() >= 2 and "embed" not in name


def decay_groups(named: Iterable[tuple[str, torch.Tensor]], weight_decay: float = 0.01) -> list[dict]:
    """AdamW groups of `named` parameters: decayed (`decays`), then the rest undecayed, each in the given order."""
    named = list(named)
    return [{"params": [q for n, q in named if decays(n, q)], "weight_decay": weight_decay},
            {"params": [q for n, q in named if not decays(n, q)], "weight_decay": 0.0}]


@dataclass
class LanguageModelParams:
    """The trainable model's parameters as the text jobs (`demo_model`, `lengthen`) train them: the
    language model, the DSA indexers (on their KL target) and the vision projector and tower; the
    routers' selection biases are frozen (moved by `training.distill.ExpertBalance` instead)."""
    main: dict[str, torch.Tensor]
    indexer: dict[str, torch.Tensor]
    vision: dict[str, torch.Tensor]

    @classmethod
    def of(cls, model: torch.nn.Module) -> LanguageModelParams:
        named = dict(model.named_parameters())
        bias = {n for n in named if n.endswith("e_score_correction_bias")}
        for n in bias:
            named[n].requires_grad_(False)
        indexer = {n: q for n, q in named.items() if ".indexer." in n}
        vision = {n: q for n, q in named.items() if n.startswith("vision.")}
        main = {n: q for n, q in named.items() if n not in indexer and n not in bias and n not in vision}
        return cls(main, indexer, vision)

    def optimizers(self, lr: float, indexer_lr: float) -> dict[str, torch.optim.Optimizer]:
        """"main" (decayed matrices at 0.01), "indexer" and, with a tower, "vision": group 0 the projector at
        the main rate, group 1 the tower (whose rate the job sets as a share of it)."""
        optimizers = {"main": torch.optim.AdamW(decay_groups(self.main.items()), lr=lr, betas=BETAS),
                      "indexer": torch.optim.AdamW(list(self.indexer.values()), lr=indexer_lr, betas=BETAS,
                                                   weight_decay=0.0)}
        if self.vision:
            tower = [q for n, q in self.vision.items() if n.startswith("vision.vision_tower.")]
            projector = [q for n, q in self.vision.items() if not n.startswith("vision.vision_tower.")]
            optimizers["vision"] = torch.optim.AdamW([{"params": projector}, {"params": tower}], lr=lr, betas=BETAS,
                                                     weight_decay=0.0)
        return optimizers


def clipped_step(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    """Clip the gradients of `params` to norm 1, step, and clear them."""
    torch.nn.utils.clip_grad_norm_(list(params), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def weighted_loss(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Next-token cross-entropy weighted by `weights[:, t]` for predicting `ids[:, t + 1]`, and the
    mean loss on answer tokens (weight >= 0.99) as a float (NaN when the batch has none)."""
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    w = weights[:, :-1].flatten()
    answer = w >= 0.99
    answer_loss = float(ce.detach()[answer].mean()) if bool(answer.any()) else float("nan")
    return (ce * w).sum() / w.sum(), answer_loss


def warmup_cosine(step: int, total: int, warmup: int, floor: float) -> float:
    """A linear warm-up over `warmup` steps, then a cosine from 1 down to `floor` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def stage_index(steps: Iterable[int], step: int) -> int:
    """The stage (of stages with these step counts) that `step` falls in; the last one past the end."""
    steps = list(steps)
    acc = 0
    for i, n in enumerate(steps):
        if step < acc + n:
            return i
        acc += n
    return len(steps) - 1


def tokens_left(stages, step: int) -> int:
    """Training tokens still to come after `step` (stages with `steps`, `batch`, `length`): the ETA's numerator."""
    done, acc = 0, 0
    for s in stages:
        done += min(s.steps, max(0, step - acc)) * s.batch * s.length
        acc += s.steps
    return sum(s.steps * s.batch * s.length for s in stages) - done


def git_commit() -> str:
    """The commit of the code that trains (recorded in training.json), or "" outside a repository."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def command_line(module: str, argv: list[str] | None) -> str:
    """The command that started the run, as recorded in its state and training.json."""
    return f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv)
