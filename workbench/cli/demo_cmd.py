"""`workbench demo`: the README's main job.

Until the recorded dashboard session lands, the demo shows the engine end to end: the K3.1 Pro
census at true dimensions, then a random demo-size checkpoint written to disk, loaded back and run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine import load_model
from engine.presets import get_preset
from engine.weights.write import write_checkpoint
from workbench.cli.model_cmds import cmd_inspect

DEFAULT_DIR = Path("checkpoints/demo")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the main job: demo checkpoint + session")
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_DIR, help="where the demo checkpoint lives")
    p.add_argument("--tokens", type=int, default=2048, help="prompt length of the demo forward")
    p.set_defaults(func=cmd_demo)


def ensure_demo_checkpoint(path: Path) -> Path:
    """Create the demo checkpoint on first use; reuse it afterwards."""
    if not (path / "config.json").exists():
        print(f"writing the demo checkpoint to {path} ...")
        write_checkpoint(get_preset("demo"), path, seed=0, shards=2, overwrite=True)
    return path


def cmd_demo(args: argparse.Namespace) -> int:
    cmd_inspect(argparse.Namespace(path=None, preset="k3.1-pro", variant=None, json=False))
    path = ensure_demo_checkpoint(args.checkpoint)
    model = load_model(path)
    ids = torch.randint(0, 256, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    with torch.inference_mode():
        logits = model(ids)
    elapsed = time.perf_counter() - start
    print(json.dumps({"checkpoint": str(path), "tokens": args.tokens, "seconds": round(elapsed, 3),
                      "tokens_per_s": round(args.tokens / elapsed, 1),
                      "next_token": int(logits[0, -1].argmax())}))
    return 0
