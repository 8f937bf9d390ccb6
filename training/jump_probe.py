"""Where the last DSA layer looks when the model must jump from the restated key to the value.

    python -m training.jump_probe --model builtin:demo --length 2048 --prompts 24
    python -m training.jump_probe --state STATE --length 32768 --prompts 9

Held-out needle prompts (`training.evaluate`'s cases, seed 7 unless told), teacher-forced: for each,
whether the value's first token and the whole value are predicted right, and the last DSA layer's
dense attention from the row that predicts the first value token: each head's probability on the
value's first token, and the three keys the heads attend to most (as offsets from the value's start,
with the token there). What it showed on the shipped model (training/README.md, "Why the design")
is what `training.copy_targets` trains against: wrong answers attend to a digit elsewhere in the filler.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.layers.mla import GatedMLA
from engine.tokenizer import Tokenizer
from training import state as state_io
from training.evaluate import _case
from training.model_setup import load_checkpoint_weights, trainable_model, trained_demo_config
from training.row_attention import row_attention_logp
from workbench.retrieval_text import HELD_OUT, TRAIN


@dataclass
class JumpCase:
    first_right: bool            # the value's first token, given the prompt and the prefill
    value_right: bool            # every value token, each given the right ones before it
    head_probs: list[float]      # per head of the last DSA layer: attention on the value's first token
    top_keys: list[tuple[int, str]]   # (offset from the value's first token, token) of the most attended keys
    needle: str                  # the end of the needle sentence


@torch.no_grad()
def probe(model: torch.nn.Module, tok: Tokenizer, length: int, prompts: int, seed: int = 7,
          world_name: str = "held-out", style: str = "key") -> list[JumpCase]:
    """`prompts` needle cases at depths 10/50/90% in turn (see the module docstring)."""
    world = HELD_OUT if world_name == "held-out" else TRAIN
    mod = [m for m in model.modules() if isinstance(m, GatedMLA) and m.indexer is not None][-1]
    seen: dict[str, torch.Tensor] = {}
    handle = mod.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    rng = random.Random(seed)
    out = []
    try:
        for i in range(prompts):
            seq, plen, meta = _case(tok, rng, length, (0.1, 0.5, 0.9)[i % 3], world, style)
            logits = model(torch.tensor([seq[:-1]]))
            row = plen + meta["value_at"] - 1                     # the row that predicts the first value token
            pred = logits[0, plen - 1:len(seq) - 1].argmax(-1).tolist()
            want = seq[plen:]
            at = meta["value_at"]
            start, end = meta["needle"]
            text = tok.decode(seq[start:end])
            value_pos = start + len(tok.encode(text[: text.rindex(meta["answer"])]))
            p = row_attention_logp(mod, seen["x"][:, : row + 1], torch.tensor([[row]]))[0, :, 0].exp()   # [H, row + 1]
            top = p.max(0).values.topk(min(3, p.shape[-1])).indices.tolist()
            out.append(JumpCase(first_right=pred[at] == want[at], value_right=pred[at:] == want[at:],
                                head_probs=[round(float(v), 3) for v in p[:, value_pos]],
                                top_keys=[(t - value_pos, tok.decode([seq[t]])) for t in top],
                                needle=text[-48:]))
    finally:
        handle.remove()
    return out


def load(model_ref: str | None, state: Path | None) -> torch.nn.Module:
    """The trainable demo model with a checkpoint's weights (`builtin:demo`, a directory) or a
    training state's last saved step."""
    model = trainable_model(trained_demo_config(64), 0)
    if state is not None:
        last = state_io.latest(state)
        if last is None:
            raise SystemExit(f"{state}: no saved step (no latest.json)")
        state_io.load(last, model, {})
    else:
        load_checkpoint_weights(model, model_ref or "builtin:demo")
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="a checkpoint: builtin:demo (default) or a directory")
    src.add_argument("--state", type=Path, default=None, help="a training state directory (its last saved step)")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--world", choices=("held-out", "train"), default="held-out")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = Tokenizer.byte_level()
    cases = probe(load(args.model, args.state), tok, args.length, args.prompts, args.seed, args.world)
    for c in cases:
        keys = " ".join(f"{o:+d}:{t!r}" for o, t in c.top_keys)
        print(f"{'ok ' if c.value_right else 'BAD'} first {'right' if c.first_right else 'wrong'}  "
              f"heads on the first value token {c.head_probs}  most attended {keys}  ...{c.needle!r}")
    n = len(cases)
    best = [max(c.head_probs) for c in cases]
    print(f"{args.length} tokens, {n} prompts: value right {sum(c.value_right for c in cases)}/{n}, first token right "
          f"{sum(c.first_right for c in cases)}/{n}; best head on the first value token: mean {sum(best) / n:.2f}, "
          f"above 0.5 in {sum(b > 0.5 for b in best)}/{n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
