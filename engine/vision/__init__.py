"""The image path: preprocessing, the MoonViT-V2 tower + merge + projector, placeholder expansion.

    from engine.vision import VisionModel, preprocess_image, expand_media_placeholders
    image = preprocess_image("chart.png")                       # ProcessedImage (ImageError if bad)
    vision = VisionModel(config.vision)                         # load_state_dict(vision tensors by name)
    embeds = vision(image.pixel_values, image.grid)             # [(h/2)(w/2), hidden]
    layout = expand_media_placeholders(ids, [merged_grid(image.grid)], config.media_placeholder_token_id)
"""

from engine.vision.placeholders import (ExpandedIds, ImageSpan, expand_media_placeholders, image_prompt_ids,
                                        media_token_ids)
from engine.vision.preprocess import (MAX_IMAGE_PIXELS, ImageSource, MAX_PATCHES, MAX_PATCHES_PER_SIDE, ProcessedImage,
                                      fit_to_limits, open_image, patchify, preprocess_image)
from engine.vision.tower import VisionModel, merge_patches


def merged_grid(grid: tuple[int, int], kernel: tuple[int, int] = (2, 2)) -> tuple[int, int]:
    """(h, w) patches -> (h / kh, w / kw) language-model tokens."""
    return grid[0] // kernel[0], grid[1] // kernel[1]


__all__ = ["ExpandedIds", "ImageSource", "ImageSpan", "MAX_IMAGE_PIXELS", "MAX_PATCHES", "MAX_PATCHES_PER_SIDE", "ProcessedImage",
           "VisionModel", "expand_media_placeholders", "fit_to_limits", "image_prompt_ids", "media_token_ids",
           "merge_patches", "merged_grid", "open_image", "patchify", "preprocess_image"]
