"""Embeddings -> latents, with the PixArt-Σ transformer loaded quantized and freed afterwards."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from . import memory
from .cache import cache
from .devices import as_device, resolve_dtype
from .models import ModelSource
from .quant import TRANSFORMER_SCHEMES, Quantization
from .text_encoder import PixArtEmbeds

logger = logging.getLogger(__name__)

SIZE_MULTIPLE = 16  # the VAE's 8× times the transformer's 2× patch
MIN_SIZE, MAX_SIZE = 64, 4096
MAX_BATCH = 64
MAX_STEPS = 1000
MAX_CFG = 100.0
MAX_SEED = 2**64 - 1
LATENT_CHANNELS = 4

# step index (1-based), total steps, current latents (model space)
StepCallback = Callable[[int, int, torch.Tensor], None]


def check_size(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be a whole number of pixels, got {value!r}.")
    if not MIN_SIZE <= value <= MAX_SIZE:
        raise ValueError(f"{name} {value} is out of range; use {MIN_SIZE}..{MAX_SIZE} pixels.")
    if value % SIZE_MULTIPLE:
        lower = value - value % SIZE_MULTIPLE
        raise ValueError(
            f"{name} {value} is not a multiple of {SIZE_MULTIPLE}; use {lower} or {lower + SIZE_MULTIPLE}."
        )


def _check_number(name: str, value: object, low: float, high: float, whole: bool, hint: str = "") -> None:
    kinds = (int,) if whole else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(f"{name} must be a {'whole ' if whole else ''}number, got {value!r}.")
    if not low <= value <= high:
        raise ValueError(f"{name} {value} is out of range; use {low}..{high}{hint}.")


def check_settings(width: int, height: int, steps: int, cfg: float, seed: int, batch_size: int) -> None:
    check_size("width", width)
    check_size("height", height)
    _check_number("steps", steps, 1, MAX_STEPS, whole=True)
    _check_number("cfg", cfg, 0.0, MAX_CFG, whole=False, hint=" (1 or less turns guidance off)")
    _check_number("seed", seed, 0, MAX_SEED, whole=True)
    _check_number("batch_size", batch_size, 1, MAX_BATCH, whole=True)


def check_embeds(embeds: PixArtEmbeds, caption_channels: int, model_name: str) -> None:
    if not isinstance(embeds, PixArtEmbeds):
        raise TypeError(
            f"embeds must come from Quantized T5 Encode (PIXART_EMBEDS), got {type(embeds).__name__}."
        )
    if embeds.width != caption_channels:
        raise ValueError(
            f"embeds are {embeds.width} wide but model {model_name!r} expects {caption_channels} (T5-XXL). "
            f"Encode the prompt with the T5 of the same PixArt-Σ model."
        )


def scaling_factor(source: ModelSource) -> float:
    """The VAE's latent scaling factor, read from its config without loading it."""
    return float(source.config("vae").get("scaling_factor", 0.13025))


def _load(source: ModelSource, quant: Quantization, dtype: torch.dtype, device: torch.device):
    from diffusers import PixArtTransformer2DModel

    folder = source.folder(["transformer"])
    model = PixArtTransformer2DModel.from_pretrained(folder, subfolder="transformer", dtype=dtype)
    model = quant.after_load(model)
    model.to(device)
    model.eval()
    return model


def sample(
    source: ModelSource,
    embeds: PixArtEmbeds,
    width: int = 1024,
    height: int = 1024,
    steps: int = 20,
    cfg: float = 4.5,
    seed: int = 0,
    batch_size: int = 1,
    quantization: str = "qint8",
    device: torch.device | str | None = None,
    dtype: str | torch.dtype | None = None,
    keep_loaded: bool = False,
    on_step: StepCallback | None = None,
    report: memory.MemoryReport | None = None,
) -> torch.Tensor:
    """Denoise from seeded noise; return latents ``[B, 4, H/8, W/8]`` in raw VAE space (divided by the
    VAE's scaling factor, as ComfyUI's LATENT holds them), float32 on the CPU.

    The noise is drawn on the CPU so a seed gives the same image on any device.
    """
    check_settings(width, height, steps, cfg, seed, batch_size)
    device = as_device(device)
    quant = Quantization(quantization, device, TRANSFORMER_SCHEMES)
    dtype = resolve_dtype(dtype, device, cuda_default=torch.float16, cpu_default=torch.bfloat16)
    config = source.config("transformer")
    check_embeds(embeds, config.get("caption_channels", 4096), source.name)
    scale = scaling_factor(source)
    # Drawn in fp32 on the CPU: a low-precision draw gives other numbers on some torch versions.
    noise = torch.randn(
        (embeds.batch * batch_size, LATENT_CHANNELS, height // 8, width // 8),
        generator=torch.Generator("cpu").manual_seed(seed),
        dtype=torch.float32,
    )
    with memory.stage("sample", device, report):
        latents = _sample(
            source, embeds, noise, batch_size, steps, cfg, quant, dtype, device, keep_loaded, on_step
        )
    return latents / scale


def _sample(
    source, embeds, noise, batch_size, steps, cfg, quant, dtype, device, keep_loaded, on_step
) -> torch.Tensor:
    # Its own frame: once it has returned or raised, nothing here keeps the transformer alive.
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline

    key = ("transformer", source.key, quant.scheme, dtype, str(device))
    scheduler = DPMSolverMultistepScheduler.from_pretrained(
        source.folder(["scheduler"]), subfolder="scheduler"
    )
    with cache.use(key, lambda: _load(source, quant, dtype, device), keep_loaded) as transformer:
        pipe = PixArtSigmaPipeline(
            tokenizer=None, text_encoder=None, vae=None, transformer=transformer, scheduler=scheduler
        )
        pipe.set_progress_bar_config(disable=True)

        def callback(step: int, _t, latents: torch.Tensor) -> None:
            if on_step is not None:
                on_step(step + 1, steps, latents)

        latents = pipe(
            negative_prompt=None,
            prompt_embeds=embeds.prompt_embeds.to(device, dtype),
            prompt_attention_mask=embeds.prompt_mask.to(device),
            negative_prompt_embeds=embeds.negative_embeds.to(device, dtype),
            negative_prompt_attention_mask=embeds.negative_mask.to(device),
            latents=noise.to(device, dtype),
            width=noise.shape[-1] * 8,
            height=noise.shape[-2] * 8,
            num_inference_steps=steps,
            guidance_scale=cfg,
            num_images_per_prompt=batch_size,
            output_type="latent",
            use_resolution_binning=False,
            callback=callback,
            return_dict=False,
        )[0]
    return latents.float().cpu()
