"""The sampler's ``resolution`` choices: ``custom`` (width and height), ``native`` (a square of the
model's own size) and PixArt's aspect-ratio presets for its 512, 1024 and 2048 px models, each the size
it stands for (:func:`preset_size`)."""

from __future__ import annotations

import functools

CUSTOM_RESOLUTION = "custom"
NATIVE_RESOLUTION = "native"  # a square of the model's own size (its transformer's sample_size × 8)


@functools.cache
def resolution_presets() -> dict[str, tuple[int, int]]:
    """PixArt's aspect-ratio bins for its 512, 1024 and 2048 px models: label -> (width, height)."""
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import (
        ASPECT_RATIO_512_BIN,
        ASPECT_RATIO_1024_BIN,
    )
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma import ASPECT_RATIO_2048_BIN

    presets = {}
    for base, bins in (
        (512, ASPECT_RATIO_512_BIN),
        (1024, ASPECT_RATIO_1024_BIN),
        (2048, ASPECT_RATIO_2048_BIN),
    ):
        # Each bin is keyed by height / width and holds [height, width].
        for height, width in (map(int, size) for size in bins.values()):
            presets[f"{base}: {width}×{height} ({_aspect(width, height)})"] = (width, height)
    return presets


def _aspect(width: int, height: int) -> str:
    if width == height:
        return "1:1"
    return f"{width / height:.2f}:1" if width > height else f"1:{height / width:.2f}"


def preset_size(resolution: str, width: int, height: int) -> tuple[int, int]:
    """(width, height) for a ``resolution`` choice: the preset's, or width and height when it is custom."""
    if resolution == CUSTOM_RESOLUTION:
        return width, height
    presets = resolution_presets()
    if resolution not in presets:
        raise ValueError(
            f"resolution {resolution!r} is not a preset; use {CUSTOM_RESOLUTION!r} (width and height) or a "
            f"preset such as {next(iter(presets))!r}."
        )
    return presets[resolution]
