"""The shipped checkpoint's documents: its model card (`MODEL_CARD.md`, from `MODEL_CARD.template.md` and
the run's options) and the evaluation tables the training programs print and write beside it."""

from __future__ import annotations

import json
from pathlib import Path

from training.tasks import DRILL_SHARE
from workbench.task_templates import card_files


def eval_table(rows: list[dict]) -> str:
    """Markdown table: one row per (length, mode), one column per depth; cells `v/n (w)`: the value
    right given the key in v of n prompts, the whole response (key and value) in w."""
    depths = sorted({r["depth"] for r in rows})
    lines = ["| tokens | DSA | " + " | ".join(f"depth {d:.0%}" for d in depths) + " | value | whole response |",
             "|---:|---|" + "---:|" * (len(depths) + 2)]
    for length in sorted({r["length"] for r in rows}):
        for mode in ("sparse", "dense"):
            sel = {r["depth"]: r for r in rows if r["length"] == length and r["mode"] == mode}
            if not sel:
                continue
            cells = [f"{sel[d].get('value_correct', sel[d]['correct'])}/{sel[d]['total']} ({sel[d]['correct']})"
                     if d in sel else "-" for d in depths]
            t = sum(r["total"] for r in sel.values())
            v = sum(r.get("value_correct", r["correct"]) for r in sel.values())
            c = sum(r["correct"] for r in sel.values())
            lines.append(f"| {length:,} | {mode} | " + " | ".join(cells) + f" | {v / t:.0%} | {c / t:.0%} |")
    return "\n".join(lines)


def image_line(pictures: dict, control: dict) -> str:
    per = " ".join(f"{a} {r['correct']}/{r['total']}" for a, r in pictures["by_attribute"].items())
    return f"{pictures['correct']}/{pictures['total']} ({per}; swapped-image control {control['correct']}/{control['total']})"


def data_text(run_info: dict) -> str:
    """The model card's paragraph on the training data, from the run's options."""
    varied, drills = float(run_info.get("varied_share", 0.0)), float(run_info.get("drill_share", DRILL_SHARE))
    lengths = sorted({s["length"] for s in run_info["stages"]})
    text = ("Data, generated on the fly (never stored), in the K3 chat format: passcode needles in filler\n"
            "text, several key-value facts with one or more asked for (associative recall), variable\n"
            "tracking (`Let A3 be 512. ... Then K7 takes the value of A3.`), copying a quoted span. Documents of\n"
            f"{lengths[0]:,}-{lengths[-1]:,} tokens with 1-12 facts (some restated later in the document, their values "
            "weighted as\nretrieval targets), one to three question turns; "
            f"{drills:.0%} of rows are recall drills (as many facts as\nfit, every one restated in random order). "
            "60% of the training keys contain made-up words\n(`tomune dafogi`), so an answer can only come from "
            "copying, never from a memorised key list.")
    if varied > 0:
        text += (f"\n{varied:.0%} of documents word their facts afresh (`training/wording.py`: new lead-ins, carrier "
                 "nouns, links,\nword orders and filler per document")
        text += ("; most links put one to four made-up words, training words or symbols\nbetween key and value, "
                 "never \"=\", the held-out world's link)." if run_info.get("gaps") else ").")
    if run_info.get("first_weight"):
        text += f" Each answer's first value token weighs {run_info['first_weight']:g}x in the loss."
    if int(run_info.get("image_every", 0)) > 0:
        text += (f"\nOne step in {run_info['image_every']} (outside the indexer warm-up) adds a batch of "
                 "questions about generated\npictures (`workbench.shape_pictures`: colour, shape, position of a "
                 "shape, a seven-segment digit); ")
        rate = f"(the tower at {run_info.get('tower_lr_scale', 0.1):g}x the rate)"
        tower_from = int(run_info.get("tower_from", 0))
        text += (f"the\nvision tower and projector kept their seeded init until step {tower_from}, then trained {rate}."
                 if tower_from > 0 else f"the vision tower and projector\ntrained from the first step {rate}.")
    return text


def images_text(images: dict | None, control: dict | None, untrained_tower: bool = False) -> tuple[str, str]:
    """(the card's measured image section, its "cannot do" line about images)."""
    if images is None:
        if untrained_tower:
            return "", ("- Images: the vision tower is attached with its seeded init, untrained (so that sessions with\n"
                        "  pictures run): what it answers about a picture is a guess.")
        return "", "- Images: no vision tower (text only)."
    lines = "\n".join(
        f"| {a} | {r['correct']}/{r['total']} | {control['by_attribute'].get(a, {}).get('correct', 0)}/"
        f"{control['by_attribute'].get(a, {}).get('total', 0)} | {r['chance']:.0%} |"
        for a, r in images["by_attribute"].items())
    section = ("\n## Measured: held-out image questions (exact response)\n\n"
               "Pictures drawn with other seeds than training's; the control asks each question about another "
               "picture\n(what the text alone gives).\n\n| attribute | right | swapped-image control | chance |\n"
               f"|---|---:|---:|---:|\n{lines}\n| all | {images['correct']}/{images['total']} | "
               f"{control['correct']}/{control['total']} | |\n")
    limit = ("- Images: only 64 x 64 pictures of one shape or digit on a plain ground, asked about colour,\n"
             "  shape, position or digit (table above); nothing else about a picture.")
    return section, limit


_MEASURED = ("Gradients flowed through the engine's own pure-torch layers; the routed experts were trained dense\n"
             "and quantized to MXFP4 afterwards; every figure below was measured on the quantized checkpoint as\n"
             "written, loaded with `engine.load_model`.")


def _tokens(stages: list[dict]) -> int:
    return sum(s["steps"] * s["batch"] * s["length"] for s in stages)


def _stage_lines(stages: list[dict], indent: str = "") -> str:
    return "\n".join(f"{indent}- {s.get('phase', 'sparse')}: {s['steps']} steps of {s['batch']} x {s['length']} tokens"
                     for s in stages)


def run_text(run_info: dict) -> str:
    """The card's training paragraph for one run from random init (`training.demo_model`)."""
    stages = run_info["stages"]
    return (f"`{run_info.get('command', '')}` (commit {run_info.get('commit', '')[:12] or 'unknown'}), seed "
            f"{run_info['seed']}, {sum(s['steps'] for s in stages)} steps, {_tokens(stages) / 1e6:.1f}M tokens, on "
            f"{run_info.get('hardware', 'a 2-core CPU')}.\n{_MEASURED}\n\nSchedule (DeepSeek V3.2's order for the sparse layers):\n{_stage_lines(stages)}")


def run_chain(step_dir: Path) -> list[dict]:
    """The runs that made the weights saved in `step_dir`, the run from random init first: each run's
    saved `state.json` (without its metrics), found by following every continuation's `base.base_dir`
    (`training.lengthen`). A base that is a written checkpoint, or gone, ends the chain there (the
    continuation's record of it is all that is known)."""
    chain: list[dict] = []
    d: Path | None = Path(step_dir)
    while d is not None and len(chain) < 64:
        f = d / "state.json"
        if not f.is_file():
            break
        info = json.loads(f.read_text())
        info.pop("metrics", None)
        info.pop("optimizer_steps", None)
        info["step_dir"] = str(d)
        chain.append(info)
        base = info.get("base")
        d = Path(base["base_dir"]) if isinstance(base, dict) and base.get("base_dir") and not base.get("checkpoint") \
            else None
    return chain[::-1]


def chain_loss_name(info: dict) -> str:
    """The file name a chain run's loss curve gets beside the checkpoint (`loss_<its state directory>.csv`)."""
    return f"loss_{Path(info['step_dir']).parent.name}.csv"


def chain_text(chain: list[dict]) -> str:
    """The card's training paragraph for a run and its continuations, one numbered item per run."""
    total = sum(_tokens(info.get("stages", [])) for info in chain)
    first = chain[0].get("base") if chain else None
    lines = [f"{len(chain)} runs, each continuing the last one's weights (fresh optimizer moments), "
             f"{total / 1e6:.1f}M tokens in all, on a 2-core CPU.\n{_MEASURED}", ""]
    if isinstance(first, dict):  # the chain starts from a checkpoint or a state that is gone
        lines.append(f"0. Not recorded here: the base `{first.get('base_dir')}` ({first.get('base_command') or 'its command unknown'}).")
    for i, info in enumerate(chain, 1):
        stages = info.get("stages", [])
        options = ", ".join(f"{k} {info[k]}" for k in ("lr", "varied_share", "drill_share", "first_weight", "stream",
                                                        "image_every") if info.get(k) not in (None, 0, False))
        lines.append(f"{i}. `{info.get('command', '')}` (commit {info.get('commit', '')[:12] or 'unknown'}): "
                     f"{sum(s['steps'] for s in stages)} steps, {_tokens(stages) / 1e6:.2f}M tokens "
                     f"(`{chain_loss_name(info)}`)"
                     + (f"; {options}" if options else "") + "\n" + _stage_lines(stages, "   "))
    return "\n".join(lines)


def write_model_card(out: Path, config, run_info: dict, rows: list[dict], size: int, params: int,
                     images: dict | None = None, control: dict | None = None, chain: list[dict] | None = None,
                     untrained_tower: bool = False) -> None:
    """MODEL_CARD.md for a run from random init (`run_info`), or for a chain of runs (`chain`, from
    `run_chain`; `run_info` is then the last run's, whose data options the card describes)."""
    template = (Path(__file__).parent / "MODEL_CARD.template.md").read_text()
    summ = config.summary()
    stages = [s for info in chain for s in info.get("stages", [])] if chain else run_info["stages"]
    images_section, images_limit = images_text(images, control, untrained_tower)
    card = template.format(
        params_m=f"{params / 1e6:.1f}", size_mib=f"{size / 2**20:.1f}",
        training_text=chain_text(chain) if chain else run_text(run_info),
        topk=run_info["topk"], eval_table=eval_table(rows),
        config_lines="\n".join(f"- {k}: {v}" for k, v in summ.items()),
        data_text=data_text({**run_info, "stages": stages}), longest=max(s["length"] for s in stages),
        images_section=images_section, images_limit=images_limit)
    (out / "MODEL_CARD.md").write_text(card)
    write_prompting_files(out, params, pictures=images is not None)


def prompting_notice(params: int, pictures: bool, name: str = "this checkpoint") -> str:
    """The card's one line on what the model can and cannot answer (`workbench.task_templates.card_of`
    shows it before a free-form prompt)."""
    tasks = "finding a code or number in your documents when asked in its trained wording"
    if pictures:
        tasks = f"two tasks: {tasks}, and the colour, shape, position or digit of a simple 64x64 picture"
    else:
        tasks = f"one task: {tasks}"
    return (f"{name} is a {params / 1e6:.1f}M-parameter model trained only on {tasks}; "
            "free-form questions get confident nonsense.")


def write_prompting_files(out: Path, params: int, pictures: bool) -> None:
    """generation_config.json (greedy: the model answers in its trained format only when decoded
    greedily after the prefilled key) and prompting.json (its task templates and notice) beside the card."""
    tasks = ("find-fact", "picture") if pictures else ("find-fact",)
    for name, data in card_files(tasks, prompting_notice(params, pictures), temperature=0.0,
                                 max_new_tokens=48).items():
        (out / name).write_text(json.dumps(data, indent=1) + "\n")
