"""The shipped checkpoint's documents: its model card (`MODEL_CARD.md`, from `MODEL_CARD.template.md` and
the run's options) and the evaluation tables the training programs print and write beside it."""

from __future__ import annotations

from pathlib import Path

from training.tasks import DRILL_SHARE


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
                 "shape, a seven-segment digit); the\nvision tower and projector kept their seeded init until step "
                 f"{run_info.get('tower_from', 0)}, then trained (the tower at "
                 f"{run_info.get('tower_lr_scale', 0.1):g}x the rate).")
    return text


def images_text(images: dict | None, control: dict | None) -> tuple[str, str]:
    """(the card's measured image section, its "cannot do" line about images)."""
    if images is None:
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


def write_model_card(out: Path, config, run_info: dict, rows: list[dict], size: int, params: int,
                     images: dict | None = None, control: dict | None = None) -> None:
    template = (Path(__file__).parent / "MODEL_CARD.template.md").read_text()
    summ = config.summary()
    stages = run_info["stages"]
    images_section, images_limit = images_text(images, control)
    card = template.format(
        params_m=f"{params / 1e6:.1f}", size_mib=f"{size / 2**20:.1f}", command=run_info.get("command", ""),
        commit=run_info.get("commit", "")[:12] or "unknown", seed=run_info["seed"],
        steps=sum(s["steps"] for s in stages),
        tokens_m=f"{sum(s['steps'] * s['batch'] * s['length'] for s in stages) / 1e6:.1f}",
        topk=run_info["topk"], eval_table=eval_table(rows),
        config_lines="\n".join(f"- {k}: {v}" for k, v in summ.items()),
        stage_lines="\n".join(f"- {s['phase']}: {s['steps']} steps of {s['batch']} x {s['length']} tokens"
                              for s in stages),
        data_text=data_text(run_info), longest=max(s["length"] for s in stages),
        images_section=images_section, images_limit=images_limit)
    (out / "MODEL_CARD.md").write_text(card)
