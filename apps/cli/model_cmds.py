"""Model commands: `checkpoint random`, `inspect`, `logits`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from apps.cli import logits_file
from engine import get_preset, load_config, load_model
from engine.io import inputs as engine_inputs
from engine.builtin import model_dir
from engine.weights.census import census, human, human_bytes
from engine.config import ModelConfig
from engine.errors import InputError
from engine.interventions import InterventionPlan, parse_interventions
from engine.parallel import distributed
from engine.presets import PRESETS
from engine.vision import expand_media_placeholders, merged_grid, preprocess_image
from engine.weights.load import IMAGES_UNAVAILABLE, has_vision_tensors, validate
from engine.weights.validate_values import check_values
from engine.weights.safetensors_io import CheckpointFiles
from engine.weights.write import write_checkpoint
from workbench import load_intervention_spec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def register(sub: argparse._SubParsersAction) -> None:
    ck = sub.add_parser("checkpoint", help="create checkpoints")
    ck_sub = ck.add_subparsers(dest="checkpoint_command", required=True, metavar="ACTION")
    rnd = ck_sub.add_parser("random", help="write a random checkpoint in the real on-disk layout")
    rnd.add_argument("--preset", required=True, choices=sorted(PRESETS))
    rnd.add_argument("--variant", default="k3.1", choices=["k3.1", "k3", "kimi-linear"])
    rnd.add_argument("--seed", type=int, default=0)
    rnd.add_argument("--out", required=True, type=Path)
    rnd.add_argument("--shards", type=int, default=2)
    rnd.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="storage dtype of float tensors")
    rnd.add_argument("--overwrite", action="store_true")
    rnd.add_argument("--no-vision", action="store_true",
                     help="leave out the vision tower's tensors (a text-only export; config.json keeps vision_config)")
    rnd.set_defaults(func=cmd_checkpoint_random)

    ins = sub.add_parser("inspect", help="config summary, parameter counts, bytes, tensor validation")
    ins.add_argument("path", nargs="?", type=Path, help="checkpoint directory or builtin:demo")
    ins.add_argument("--preset", choices=sorted(PRESETS))
    ins.add_argument("--variant", choices=["k3.1", "k3", "kimi-linear"])
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.add_argument("--headers-only", action="store_true",
                     help="check names, shapes and dtypes only, not the values (NaN/inf, E8M0 0xFF)")
    ins.set_defaults(func=cmd_inspect)

    lg = sub.add_parser("logits", help="full causal forward of token id lists; write logits")
    lg.add_argument("--model", required=True, help="checkpoint directory, builtin:demo (the trained demo model) or preset:NAME[:VARIANT] (random weights)")
    lg.add_argument("--input-ids", required=True, type=Path,
                    help='JSON list of token-id lists or {"input_ids": [...], "images": ["a.png", ...]} objects '
                         "(one <|media_pad|> per image; paths relative to the JSON file; logits cover the "
                         "expanded sequence)")
    lg.add_argument("--out", required=True, type=Path, help="output .safetensors (logits.0, logits.1, ...)")
    lg.add_argument("--overwrite", action="store_true", help="replace logits this command wrote before at --out")
    lg.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    lg.add_argument("--seed", type=int, default=0, help="weights seed for preset: models")
    lg.add_argument("--dsa-dense", action="store_true", help="read every past key on DSA layers (K3-style)")
    lg.add_argument("--intervene", type=Path, metavar="SPEC_JSON",
                    help="apply interventions to every sequence: a JSON list with token positions "
                         "(engine.interventions; a sequence has no segment names)")
    add_parallel_args(lg)
    lg.set_defaults(func=cmd_logits)


def cmd_checkpoint_random(args: argparse.Namespace) -> int:
    if args.shards < 1:
        raise InputError("--shards must be >= 1")
    config = get_preset(args.preset, args.variant)
    out = write_checkpoint(config, args.out, seed=args.seed, shards=args.shards, float_dtype=DTYPES[args.dtype],
                           overwrite=args.overwrite, vision=not args.no_vision)
    tower = ("no vision tower" if config.vision is None else "text-only (no vision tensors)" if args.no_vision
             else f"vision tower {config.vision.num_layers} x {config.vision.hidden_size}")
    print(f"wrote {config.variant} checkpoint of preset {args.preset!r} (seed {args.seed}, {tower}) to {out}")
    return 0


def summarize(config: ModelConfig) -> dict:
    c = config.summary()
    return {
        **{k: c[k] for k in ("variant", "layers", "kda_layers", "mla_layers", "dsa_layers", "hidden_size",
                             "vocab_size", "attention_heads")},
        "kda_heads": f"{config.kda_num_heads} x {config.kda_head_dim}",
        "dsa": None if config.dsa is None else f"{config.dsa.n_heads} heads x {config.dsa.head_dim}, "
                                               f"top-k {config.dsa.topk}",
        "experts": f"{c['num_experts']} routed (top {c['experts_per_token']}) + {c['shared_experts']} shared",
        **{k: c[k] for k in ("expert_format", "latent_moe", "attn_res_block_size", "max_position_embeddings",
                             "config_hash")},
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    if (args.path is None) == (args.preset is None):
        raise InputError("give a checkpoint directory or --preset NAME (exactly one)")
    files = None
    problems: list[str] = []
    images_note = ""
    if args.preset:
        config = get_preset(args.preset, args.variant)
        source = f"preset {args.preset}" + (f" ({args.variant})" if args.variant else "")
    else:
        path = model_dir(args.path)
        config = load_config(path)
        files = CheckpointFiles.open(path)
        problems = validate(config, files)
        if not args.headers_only:  # streamed through the memory maps: bounded memory at any size
            problems += [str(p) for p in check_values(files, config)]
        source = str(args.path)
        if config.vision is not None and not has_vision_tensors(config, files):
            images_note = IMAGES_UNAVAILABLE
    counts = census(config, files)
    report = {
        "source": source,
        "config": summarize(config),
        "parameters": {"total": counts.total, "active_per_token": counts.active, "vision": counts.vision,
                       "by_component": dict(counts.by_component)},
        "bytes_by_dtype": dict(counts.bytes_by_dtype),
        "total_bytes": counts.total_bytes,
        "validation": {"checked": files is not None, "values_checked": files is not None and not args.headers_only,
                       "problems": problems},
        "images": {"available": config.vision is not None and not images_note, "note": images_note or None},
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"source: {source}")
        for k, v in report["config"].items():
            print(f"  {k:24s} {v}")
        print(f"parameters: {human(counts.total)} total, {human(counts.active)} active per token"
              + (f", vision {human(counts.vision)}" if counts.vision else ""))
        for comp, n in sorted(counts.by_component.items(), key=lambda kv: -kv[1]):
            print(f"  {comp:24s} {human(n)}")
        print(f"bytes: {human_bytes(counts.total_bytes)}")
        for dt, n in sorted(counts.bytes_by_dtype.items(), key=lambda kv: -kv[1]):
            print(f"  {dt:24s} {human_bytes(n)}")
        if files is not None:
            if problems:
                print(f"validation: {len(problems)} problems")
                for p in problems:
                    print(f"  - {p}")
            else:
                what = "match config.json" if args.headers_only else "match config.json, all values finite"
                print(f"validation: ok ({len(files.tensors)} tensors {what})")
            if images_note:
                print(f"images: unavailable ({images_note})")
    return 1 if problems else 0



def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Options of commands that also run split over ranks (`torchrun --nproc-per-node N -m workbench ...`)."""
    p.add_argument("--check-ranks", action="store_true",
                   help="under torchrun: verify every forward that all ranks chose the same DSA keys and experts")


def sequence_inputs(model, seq: engine_inputs.InputSequence, index: int,
                    device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input ids [1, T], image embeddings or None) of one entry; images expand their `<|media_pad|>`."""
    if not seq.images:
        return torch.tensor([seq.input_ids], dtype=torch.long, device=device), None
    c, pad = model.config.vision, model.config.media_placeholder_token_id
    if c is None or pad is None:
        raise InputError(f"sequence {index} has images but this model has no vision tower")
    if model.vision_unavailable:
        raise InputError(f"sequence {index} has images but images are unavailable: {model.vision_unavailable}")
    processed = [preprocess_image(path, patch=c.patch_size, merge=c.merge_kernel) for path in seq.images]
    try:
        layout = expand_media_placeholders(seq.input_ids, [merged_grid(p.grid, c.merge_kernel) for p in processed], pad)
    except InputError as exc:
        raise InputError(f"sequence {index}: {exc}") from None
    embeds = model.encode_images(processed)
    return layout.input_ids[None].to(device), torch.cat(embeds)


def cmd_logits(args: argparse.Namespace) -> int:
    sequences = engine_inputs.read_sequences(args.input_ids)
    interventions = parse_interventions(load_intervention_spec(args.intervene)) if args.intervene is not None else ()
    logits_file.check_target(args.out, overwrite=args.overwrite)  # before the model is loaded, not after the forward
    with distributed(debug_checks=args.check_ranks) as ctx:  # world 1 unless launched by torchrun
        model = load_model(args.model, dtype=DTYPES[args.dtype], seed=args.seed, parallel=ctx, device=ctx.device)
        model.runtime.dsa_force_dense = args.dsa_dense
        # checked against the model before any forward runs
        model.runtime.interventions = InterventionPlan(interventions, model.config, ctx.device) if interventions else None
        out: dict[str, torch.Tensor] = {}
        with torch.inference_mode():
            for i, seq in enumerate(sequences):
                ids, image_embeds = sequence_inputs(model, seq, i, ctx.device)
                if ids.shape[1] > model.config.max_position_embeddings:
                    raise InputError(f"sequence {i} has {ids.shape[1]} tokens; the model's limit is "
                                     f"{model.config.max_position_embeddings}")
                out[f"logits.{i}"] = model(ids, image_embeds=image_embeds)[0].float().cpu().contiguous()
        if ctx.is_leader:  # every rank holds the full logits; one writes them
            logits_file.write(args.out, out, {"model": str(args.model), "config_hash": model.config.fingerprint()},
                              overwrite=args.overwrite)
            print(f"wrote {len(out)} logits tensors to {args.out}")
    return 0
