"""Latents -> images with the VAE, loaded for the decode and freed afterwards."""

from __future__ import annotations

import torch

from . import memory
from .cache import cache
from .devices import as_device, resolve_dtype
from .models import ModelSource
from .sampler import LATENT_CHANNELS


def check_latents(samples: object) -> None:
    if not isinstance(samples, torch.Tensor):
        raise TypeError(f"latent must hold a tensor under 'samples', got {type(samples).__name__}.")
    if samples.ndim != 4 or samples.shape[1] != LATENT_CHANNELS:
        raise ValueError(
            f"latent has shape {tuple(samples.shape)}; PixArt-Σ's VAE decodes [batch, {LATENT_CHANNELS}, "
            f"height/8, width/8]. Feed it the LATENT of Quanto PixArt Sampler or of an SDXL-family node."
        )


def _load(source: ModelSource, dtype: torch.dtype, device: torch.device):
    from diffusers import AutoencoderKL

    model = AutoencoderKL.from_pretrained(source.folder(["vae"]), subfolder="vae", dtype=dtype)
    model.to(device)
    model.eval()
    return model


def decode(
    source: ModelSource,
    samples: torch.Tensor,
    device: torch.device | str | None = None,
    dtype: str | torch.dtype | None = None,
    keep_loaded: bool = False,
    report: memory.MemoryReport | None = None,
) -> torch.Tensor:
    """Decode raw-VAE-space latents ``[B, 4, h, w]`` to images ``[B, 8h, 8w, 3]`` float32 in 0..1 on the CPU."""
    check_latents(samples)
    device = as_device(device)
    # The SDXL VAE overflows in fp16 (hence ComfyUI decodes it in bf16 or fp32).
    dtype = resolve_dtype(dtype, device, cuda_default=torch.bfloat16, cpu_default=torch.float32)
    with memory.stage("vae_decode", device, report):
        return _decode(source, samples, dtype, device, keep_loaded)


def _decode(source, samples, dtype, device, keep_loaded) -> torch.Tensor:
    # Its own frame: once it has returned or raised, nothing here keeps the VAE alive.
    key = ("vae", source.key, dtype, str(device))
    with cache.use(key, lambda: _load(source, dtype, device), keep_loaded) as vae:
        decoded = vae.decode(samples.to(device, dtype), return_dict=False)[0]
    return (decoded.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu()
