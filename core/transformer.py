"""The PixArt-Σ transformer in CPU memory, quantized: where its weights come from (its model folder or one
safetensors file), read in the settings' dtype, quantized by their scheme or read back from the
pre-quantized cache. The sampler (:mod:`.sampler`) runs it; the pack's int8 MODEL (``nodes/int8_model.py``)
holds it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import quant_cache
from .models import ModelSource, check_weights
from .single_files import TransformerFile, read_transformer_file

if TYPE_CHECKING:
    from .sampler import SamplerSettings


def transformer_weights(
    source: ModelSource, transformer_file: str | os.PathLike | None = None
) -> ModelSource | TransformerFile:
    """Where the transformer comes from: ``source``'s transformer/ folder, or ``transformer_file`` (one
    safetensors file) whose config fills what its weights do not say from ``source``'s transformer config
    where ``source`` has one."""
    if transformer_file is None:
        return source
    try:
        folder_config = source.config("transformer")
    except FileNotFoundError:
        folder_config = {}
    return read_transformer_file(transformer_file, folder_config)


def _from_file(weights: TransformerFile, dtype: torch.dtype):
    """A transformer built empty from the file's inferred config, then given the file's weights (renamed
    to diffusers' keys): diffusers has no single-file loader for PixArt."""
    model = empty(weights.config)
    # The weights in ``dtype``; the position embedding buffer stays float32, as from_pretrained keeps it.
    model.load_state_dict({key: value.to(dtype) for key, value in weights.state_dict().items()}, assign=True)
    return model


def quantized_transformer(settings: SamplerSettings):
    """The transformer in CPU memory, quantized by the settings' scheme with its quantized layers plain ones
    (``plain_modules``), in eval mode without gradients: what the sampler runs and the pack's MODEL holds.
    With ``settings.quant_cache`` a scheme whose backend saves its work is quantized once and read back from
    there afterwards (:mod:`quant_cache`)."""
    weights, scheme = settings.weights, settings.scheme
    if isinstance(weights, TransformerFile):
        origin = weights.path
    else:
        origin = check_weights(weights.folder(["transformer"]) / "transformer", weights.name)

    def quantize():
        return scheme.after_load(read(settings, origin))

    if settings.quant_cache is None or not scheme.saves_quantized:
        model = quantize()
    else:
        recipe = {"scheme": scheme.name, "dtype": settings.dtype, "class": "PixArtTransformer2DModel"}
        if isinstance(weights, TransformerFile):
            recipe["config"] = weights.config  # inferred, so a change in the inference is a new entry
        model = quant_cache.load_or_build(
            quant_cache.entry(settings.quant_cache, "transformer", origin, recipe),
            load=lambda folder: scheme.load_quantized(empty(settings.config), folder),
            build=quantize,
            save=scheme.save_quantized,
        )
    model.eval().requires_grad_(False)
    scheme.plain_modules(model)
    return model


def read(settings: SamplerSettings, origin: Path):
    """The transformer's weights as they are on disk (``origin``: its file, or its checked folder), in the
    settings' dtype, on the CPU."""
    from diffusers import PixArtTransformer2DModel

    if isinstance(settings.weights, TransformerFile):
        return _from_file(settings.weights, settings.dtype)
    return PixArtTransformer2DModel.from_pretrained(origin, dtype=settings.dtype, use_safetensors=True)


def empty(config: dict):
    """The transformer's architecture with its parameters on the meta device (its buffers, such as the
    float32 position embedding, made as from_pretrained makes them)."""
    from accelerate import init_empty_weights
    from diffusers import PixArtTransformer2DModel

    with init_empty_weights():
        return PixArtTransformer2DModel.from_config(config)
