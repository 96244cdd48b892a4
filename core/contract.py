"""What passes between the stages, and the checks every stage shares.

The three stages (text_encoder, sampler, vae) stand side by side: each imports this module, none
imports another. The encoder hands the sampler :class:`PixArtEmbeds`; the sampler hands the decoder
LATENT samples, ``[batch, 4, height/8, width/8]`` float32 tensors in raw VAE space (ComfyUI's form).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

SIZE_MULTIPLE = 16  # the VAE's 8× times the transformer's 2× patch
MIN_SIZE, MAX_SIZE = 64, 4096
LATENT_CHANNELS = 4  # the SDXL VAE's

# done, total, and for the sampler the current latents (model space); None for the other stages.
ProgressCallback = Callable[[int, int, "torch.Tensor | None"], None]
WarningCallback = Callable[[str], None]


@dataclass(frozen=True)
class PixArtEmbeds:
    """What the encoder hands the sampler: padded embeddings and masks, kept on the CPU."""

    prompt_embeds: torch.Tensor  # [B, 300, C]
    prompt_mask: torch.Tensor  # [B, 300]
    negative_embeds: torch.Tensor
    negative_mask: torch.Tensor
    model: str  # which weights produced them
    quantization: str
    dtype: torch.dtype

    @property
    def width(self) -> int:
        return self.prompt_embeds.shape[-1]

    @property
    def batch(self) -> int:
        return self.prompt_embeds.shape[0]


def check_embeds(embeds: object, caption_channels: int | None = None, model_name: str = "") -> PixArtEmbeds:
    """``embeds`` are the text encoder's (and, with ``caption_channels``, as wide as the model reads)."""
    if not isinstance(embeds, PixArtEmbeds):
        raise TypeError(
            f"embeds must be the T5 encoder's PixArtEmbeds (PIXART_EMBEDS), got {type(embeds).__name__}."
        )
    if caption_channels is not None and embeds.width != caption_channels:
        raise ValueError(
            f"embeds are {embeds.width} wide but model {model_name!r} expects {caption_channels} (T5-XXL). "
            f"Encode the prompt with the T5 of the same PixArt-Σ model."
        )
    return embeds


def check_number(name: str, value: object, low: float, high: float, whole: bool, hint: str = "") -> None:
    kinds = (int,) if whole else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(f"{name} must be a {'whole ' if whole else ''}number, got {value!r}.")
    if not low <= value <= high:
        raise ValueError(f"{name} {value} is out of range; use {low}..{high}{hint}.")


def check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false, got {value!r}.")


def check_size(name: str, value: object) -> None:
    check_number(name, value, MIN_SIZE, MAX_SIZE, whole=True, hint=" pixels")
    if value % SIZE_MULTIPLE:
        lower = value - value % SIZE_MULTIPLE
        raise ValueError(
            f"{name} {value} is not a multiple of {SIZE_MULTIPLE}; use {lower} or {lower + SIZE_MULTIPLE}."
        )


def check_each(*checks: Callable[[], object]) -> list:
    """Run every one of ``checks`` (checks, or settings to make) and return what each returned; when any
    refuses its input, raise one error that names every refusal in order, not only the first."""
    results, problems = [], []
    for check in checks:
        try:
            results.append(check())
        except (ValueError, TypeError) as exc:
            problems.append(exc)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ValueError(" ".join(dict.fromkeys(str(problem) for problem in problems)))
    return results


def check_latent_tensor(latents: object, use: str, fix: str) -> torch.Tensor:
    """A LATENT's samples must be a [batch, 4, h, w] tensor (the SDXL VAE's latents)."""
    if not isinstance(latents, torch.Tensor):
        raise TypeError(f"latent must hold a tensor under 'samples', got {type(latents).__name__}.")
    if latents.ndim != 4 or latents.shape[1] != LATENT_CHANNELS:
        raise ValueError(
            f"latent has shape {tuple(latents.shape)}; {use} [batch, {LATENT_CHANNELS}, height/8, width/8]. {fix}"
        )
    return latents


def warn(logger: logging.Logger, message: str | None, on_warning: WarningCallback | None) -> None:
    """Log a stage's warning and hand it to the front end (a node shows it on itself)."""
    if message is None:
        return
    logger.warning("%s", message)
    if on_warning is not None:
        on_warning(message)
