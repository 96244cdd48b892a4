"""Latents -> images with the VAE, loaded for the decode and freed afterwards."""

from __future__ import annotations

import torch

from . import memory
from .cache import cache
from .devices import as_device, resolve_dtype
from .models import ModelSource
from .sampler import check_latent_tensor

TILING = ("auto", "on", "off")
TILE_SIZE = (
    512  # pixels; diffusers' default tile is the config's sample_size (1024), too big to engage at 1024²
)
MIN_TILE_SIZE = 64
# An untiled SDXL-VAE decode holds about this many activation bytes per output pixel and per byte of
# its dtype (measured: 2.4 GiB over the weights at 1024² in bf16), plus a margin.
ACTIVATION_BYTES_PER_PIXEL = 1300


def check_latents(samples: object) -> None:
    check_latent_tensor(
        samples,
        "PixArt-Σ's VAE decodes",
        "Feed it the LATENT of Quanto PixArt Sampler or of an SDXL-family node.",
    )


def _load(source: ModelSource, dtype: torch.dtype, device: torch.device):
    from diffusers import AutoencoderKL

    model = AutoencoderKL.from_pretrained(source.folder(["vae"]), subfolder="vae", dtype=dtype)
    model.to(device)
    model.eval()
    return model


def untiled_bytes(samples: torch.Tensor, dtype: torch.dtype) -> int:
    """Estimated activation memory of an untiled decode of ``samples``."""
    batch, _, height, width = samples.shape
    return batch * height * width * 64 * dtype.itemsize * ACTIVATION_BYTES_PER_PIXEL


def use_tiles(tiling: str, samples: torch.Tensor, dtype: torch.dtype, device: torch.device) -> bool:
    """``auto`` tiles when the untiled decode would not fit in the device's free memory."""
    if tiling not in TILING:
        raise ValueError(f"tiling {tiling!r} is unknown; choose one of {', '.join(TILING)}.")
    if tiling != "auto":
        return tiling == "on"
    if not memory.cuda_in_use(device):
        return False
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return untiled_bytes(samples, dtype) > free + cached


def decode(
    source: ModelSource,
    samples: torch.Tensor,
    device: torch.device | str | None = None,
    dtype: str | torch.dtype | None = None,
    keep_loaded: bool = False,
    tiling: str = "auto",
    tile_size: int = TILE_SIZE,
    report: memory.MemoryReport | None = None,
) -> torch.Tensor:
    """Decode raw-VAE-space latents ``[B, 4, h, w]`` to images ``[B, 8h, 8w, 3]`` float32 in 0..1 on the CPU.

    ``tiling``: ``on`` decodes in overlapping, blended tiles of ``tile_size`` pixels (much less
    memory), ``off`` in one piece, ``auto`` tiles when the whole would not fit in free GPU memory.
    """
    check_latents(samples)
    if (
        isinstance(tile_size, bool)
        or not isinstance(tile_size, int)
        or tile_size < MIN_TILE_SIZE
        or tile_size % 8
    ):
        raise ValueError(
            f"tile_size {tile_size!r} is not allowed; use a multiple of 8 pixels, at least {MIN_TILE_SIZE}."
        )
    device = as_device(device)
    # The SDXL VAE overflows in fp16 (hence ComfyUI decodes it in bf16 or fp32).
    dtype = resolve_dtype(dtype, device, cuda_default=torch.bfloat16, cpu_default=torch.float32)
    tile = tile_size if use_tiles(tiling, samples, dtype, device) else None
    with memory.stage("vae_decode", device, report):
        return _decode(source, samples, dtype, device, keep_loaded, tile)


def _decode(source, samples, dtype, device, keep_loaded, tile: int | None) -> torch.Tensor:
    # Its own frame: once it has returned or raised, nothing here keeps the VAE alive.
    key = ("vae", source.key, dtype, str(device))
    with cache.use(key, lambda: _load(source, dtype, device), keep_loaded) as vae:
        # A kept VAE may come back from a tiled run: set its mode every time.
        vae.use_tiling = tile is not None
        if tile is not None:
            vae.tile_sample_min_size, vae.tile_latent_min_size = tile, tile // 8
        decoded = vae.decode(samples.to(device, dtype), return_dict=False)[0]
    return (decoded.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu()
