"""Images under torchrun: the replicated tower gives every rank the same image embeddings, so world 2
gives world 1's logits for a prompt with two images (`workbench logits` with image entries)."""

from __future__ import annotations

import json

import torch
from PIL import Image, ImageDraw
from safetensors.torch import load_file

from engine import load_model
from engine.vision import expand_media_placeholders, merged_grid, preprocess_image
from tests.engine.test_parallel import _torchrun
from tests.helpers import assert_close


def test_world2_equals_world1_for_a_prompt_with_images(checkpoint_dir, tmp_path):
    path = checkpoint_dir("tiny", "k3.1", seed=0, dtype=torch.bfloat16)
    sizes = {"aligned.png": (112, 84), "odd.png": (75, 61)}  # a multiple of 28 px, and not
    for name, (w, h) in sizes.items():
        im = Image.new("RGB", (w, h), "white")
        ImageDraw.Draw(im).rectangle([w // 4, h // 4, w // 2, h // 2], fill="purple")
        im.save(tmp_path / name)
    pad = 256 + 21
    ids = list(b"A document before the images. " * 6) + [pad] + list(b" and ") + [pad] + list(b" which is larger?")
    spec = tmp_path / "ids.json"
    spec.write_text(json.dumps([{"input_ids": ids, "images": list(sizes)}]))
    out = tmp_path / "logits.safetensors"
    done = _torchrun(2, "logits", "--model", str(path), "--input-ids", str(spec), "--out", str(out))
    assert done.returncode == 0, done.stderr
    got = load_file(str(out))["logits.0"]
    model = load_model(path)
    processed = [preprocess_image(tmp_path / name) for name in sizes]
    layout = expand_media_placeholders(ids, [merged_grid(p.grid) for p in processed], pad)
    with torch.inference_mode():
        want = model(layout.input_ids[None], image_embeds=torch.cat(model.encode_images(processed)))[0]
    assert got.shape[0] == len(ids) - 2 + sum(s.length for s in layout.spans)
    assert_close(got, want, "world-2 logits of a prompt with images vs world 1")
