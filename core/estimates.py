"""What a stage holds on its device at most, in bytes: the room a host application with its own models
(ComfyUI) is asked to make before the stage loads. Each stage's settings object calls these
(``device_bytes``); the per-scheme figures are the schemes' own (``quant.Scheme.device_bytes``).

Measured on PixArt-Σ XL at 1024², batch 1, cfg on (peaks allocated, in the retired stages benchmark: `git log -p -- benchmarks/results/stages.json`); the
run's part scales with pixels × batch. Smaller models get the XL figures: asking for too much room only
unloads more of the host's models than needed, asking for too little can run out of memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant import GIB, Scheme

MEGAPIXEL = 1024 * 1024

# The XL transformer's 611 M parameters. Sampling adds about 0.3 GiB per megapixel and image (0.87 GiB
# peak with qint8 at 1024², 1.41 GiB in fp16).
TRANSFORMER_PARAMETERS = 611_000_000
TRANSFORMER_WORK_PER_MEGAPIXEL = int(0.3 * GIB)

# Low-VRAM mode (streaming.py) holds on the device the blocks in flight (the running one and the next)
# plus the small resident parts: measured T5 nf4 0.40 GiB, bf16 0.85 GiB; transformer qint8 0.33 GiB.
T5_LAYERS, TRANSFORMER_BLOCKS, BLOCKS_IN_FLIGHT = 24, 28, 2
T5_STREAMED_EXTRA = int(0.2 * GIB)  # quantization state, final norm, activations

# What low-VRAM mode holds a stage to: a model whose whole weights and run fit is kept whole on the device
# for its run (the int8 transformer at 1024²: 0.85 GiB measured), a larger one streams its blocks (T5-XXL in nf4).
LOW_VRAM_BUDGET = 1 * GIB

# An untiled SDXL-VAE decode holds about this many activation bytes per output pixel and per byte of
# its dtype (measured on an H200: 1.72 GiB over the weights at 1024² in bf16, its convolutions in strips),
# plus a margin.
VAE_ACTIVATION_BYTES_PER_PIXEL = 950
# A tiled decode at 512-pixel tiles (vae.TILE_SIZE) peaked at 0.80 GiB in bf16, 0.16 GiB of it the weights
# (84 M parameters).
VAE_PARAMETERS = 84_000_000
VAE_MEASURED_TILE = 512
VAE_TILED_WORK_BYTES_PER_PIXEL = 0.64 * GIB / VAE_MEASURED_TILE**2 / 2  # per tile pixel and dtype byte


@dataclass(frozen=True)
class Workload:
    """What a stage's run is asked to do, as far as the memory it holds and the model it keeps depend on it:
    ``images`` images of ``pixels`` pixels each, decoded whole or in tiles of ``tile`` pixels. Every stage's
    settings take one (``cache_key``, ``device_bytes``); T5's run depends on none of it (``Workload()``)."""

    images: int = 1
    pixels: int = 0
    tile: int | None = None

    @classmethod
    def of(cls, latents: torch.Tensor, tile: int | None = None) -> Workload:
        """The run on a batch of latents ``[B, 4, h, w]``: B images of 8h × 8w pixels."""
        return cls(latents.shape[0], latents.shape[-1] * latents.shape[-2] * 64, tile)


def text_encoder(scheme: Scheme, dtype: torch.dtype, low_vram: bool = False) -> tuple[int, int]:
    """(weights, work) of the T5 stage; the run itself is small next to the weights (300 tokens)."""
    weights = scheme.bytes_at(dtype)
    if low_vram:
        weights = weights * BLOCKS_IN_FLIGHT // T5_LAYERS + T5_STREAMED_EXTRA
    return weights, 0


def transformer(
    scheme: Scheme,
    dtype: torch.dtype,
    images: int,
    pixels: int,
    low_vram: bool = False,
    dense: bool = False,
) -> tuple[int, int]:
    """(weights, work) of the sampler stage for ``images`` images of ``pixels`` pixels each; ``low_vram``:
    its blocks streamed; ``dense``: its quantized weights held expanded to ``dtype`` for the run (the work
    then includes that copy)."""
    work = TRANSFORMER_WORK_PER_MEGAPIXEL * images * pixels // MEGAPIXEL
    weights = TRANSFORMER_PARAMETERS * scheme.bytes_at(dtype)
    if low_vram:
        weights = weights * BLOCKS_IN_FLIGHT // TRANSFORMER_BLOCKS
    if dense:
        work += TRANSFORMER_PARAMETERS * dtype.itemsize
    return weights, work


def vae_decode(work: Workload, dtype: torch.dtype) -> tuple[int, int]:
    """(weights, work) of a VAE decode: untiled, its activations per output pixel; tiled, per tile."""
    weights = VAE_PARAMETERS * dtype.itemsize
    if work.tile is None:
        return weights, work.images * work.pixels * dtype.itemsize * VAE_ACTIVATION_BYTES_PER_PIXEL
    return weights, int(work.images * work.tile * work.tile * dtype.itemsize * VAE_TILED_WORK_BYTES_PER_PIXEL)


def vae_needs(samples: torch.Tensor, dtype: torch.dtype, tile: int | None) -> tuple[int, int]:
    """(weights, work) of a decode of ``samples``, whole or in tiles of ``tile`` pixels."""
    return vae_decode(Workload.of(samples, tile), dtype)


def vae_untiled_bytes(samples: torch.Tensor, dtype: torch.dtype) -> int:
    """Estimated activation memory of an untiled decode of ``samples``."""
    return vae_decode(Workload.of(samples), dtype)[1]
