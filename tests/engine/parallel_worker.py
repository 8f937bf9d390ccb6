"""One rank of a parallel test job (launched by tests/engine/test_parallel.py, or by torchrun).

Loads the model split over the job's ranks, runs the full causal forward of one prompt and a
greedy session continuing it, and has rank 0 write both to `--out` (safetensors). Switches
inject the failures the tests look for: a rank that raises, a rank with another config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine import load_model
from engine.interventions import InterventionPlan, parse_interventions
from engine.parallel import distributed
from engine.session import Session

PROMPT = [3, 141, 59, 265, 35, 89, 79, 323, 84, 62, 64, 338, 327, 95, 28, 84, 197, 169, 399, 375, 105, 82]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out")
    p.add_argument("--new-tokens", type=int, default=6)
    p.add_argument("--fail-rank", type=int, default=-1, help="this rank raises after loading")
    p.add_argument("--die-rank", type=int, default=-1, help="this rank vanishes after loading (no report)")
    p.add_argument("--other-model-on-rank", type=int, default=-1, help="this rank loads --other-model")
    p.add_argument("--other-model")
    p.add_argument("--check-ranks", action="store_true", help="cross-rank invariant checks in every forward")
    p.add_argument("--intervene", default="[]", help="a JSON intervention spec for the forward and the session")
    args = p.parse_args()
    torch.set_num_threads(1)
    with distributed(debug_checks=args.check_ranks, heartbeat_timeout_s=10.0) as ctx:
        path = args.other_model if ctx.rank == args.other_model_on_rank else args.model
        model = load_model(path, parallel=ctx, device=ctx.device)
        if ctx.rank == args.fail_rank:
            raise RuntimeError("injected failure")
        if ctx.rank == args.die_rank:
            os._exit(3)
        items = parse_interventions(json.loads(args.intervene))
        model.runtime.interventions = InterventionPlan(items, model.config, ctx.device) if items else None
        with torch.inference_mode():
            logits = model(torch.tensor([PROMPT]))[0]
        model.runtime.interventions = None
        session = Session(model)
        session.set_interventions(items)
        session.append(ids=PROMPT)
        tokens = [t.id for t in session.generate(max_new_tokens=args.new_tokens, temperature=0)]
        if ctx.is_leader and args.out:
            save_file({"logits": logits.float().contiguous(), "tokens": torch.tensor(tokens)}, args.out)
    # the model still holds the context here: shutdown must have released the group anyway, or
    # gloo's threads end during interpreter teardown, which aborts the process now and then
    left = [name for name in _native_thread_names() if "gloo" in name]
    if left:
        print(f"gloo threads still running after shutdown: {left}", file=sys.stderr)
        return 4
    return 0


def _native_thread_names() -> list[str]:
    tasks = Path(f"/proc/{os.getpid()}/task")
    if not tasks.is_dir():  # not Linux: nothing to check
        return []
    return [(task / "comm").read_text().strip() for task in tasks.iterdir()]


if __name__ == "__main__":
    sys.exit(main())
