"""Reference outputs from transformers' `KimiLinearForCausalLM`, computed in a process of its own.

Run as `python tests/oracles/hf_kimi_linear.py CASES.json OUT_DIR`. For every case in the JSON list
(`{"name", "seed", "seq_lens", "config": {KimiLinearConfig kwargs}}`) it

1. builds a random model in fp32 with eager attention, then perturbs every norm weight and the
   router's `e_score_correction_bias` (transformers initialises them to ones / zeros, which would
   let a wrong norm or a missing bias go unnoticed);
2. writes it with `save_pretrained` to `OUT_DIR/<name>/` (the real Kimi-Linear checkpoint layout);
3. runs each sequence length on random ids and stores, in `OUT_DIR/<name>/reference.safetensors`,
   `ids_T{T}` [1, T], `logits_T{T}` [1, T, vocab] and `layer{L}_T{T}` [1, T, hidden] (every decoder
   layer's output, captured with forward hooks: the pre-norm residual stream, including the last layer).

fla is blocked before transformers is imported: when fla is importable transformers routes KDA to
its Triton kernels, which cannot run on a CPU (spec section 11). That is also why this runs in a
subprocess and never inside pytest's own process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.modules["fla"] = None  # type: ignore[assignment]  # must precede the transformers import

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402


def _perturb(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Give norms and the selection bias values a wrong implementation could not ignore."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=gen))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.2 * torch.randn(buf.shape, generator=gen))


def run_case(case: dict, out_dir: Path) -> None:
    # eager attention and the eager per-expert loop: the plain PyTorch paths, no fused kernels
    config = KimiLinearConfig(**case["config"], attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(case["seed"])
    model = KimiLinearForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(case["seed"])
    _perturb(model, gen)
    target = out_dir / case["name"]
    model.save_pretrained(target)

    captured: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().clone()))
             for layer in model.model.layers]
    refs: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for T in case["seq_lens"]:
            ids = torch.randint(0, config.vocab_size, (1, T), generator=gen)
            captured.clear()
            logits = model(input_ids=ids, use_cache=False).logits
            refs[f"ids_T{T}"] = ids
            refs[f"logits_T{T}"] = logits.float().contiguous()
            for i, hidden in enumerate(captured):
                refs[f"layer{i}_T{T}"] = hidden.float().contiguous()
    for hook in hooks:
        hook.remove()
    save_file(refs, str(target / "reference.safetensors"))


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit(f"usage: {argv[0]} CASES.json OUT_DIR")
    torch.set_num_threads(2)
    cases = json.loads(Path(argv[1]).read_text())
    out_dir = Path(argv[2])
    for case in cases:
        run_case(case, out_dir)


if __name__ == "__main__":
    main(sys.argv)
