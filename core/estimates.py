"""What a stage holds on its device at most, in bytes: the room a host application with its own models
(ComfyUI) is asked to make before the stage loads (``cache.use(..., weights=, work=)``).

Measured on PixArt-Σ XL at 1024², batch 1, cfg on (benchmarks/results/results.md, peaks allocated); the
run's part scales with pixels × batch. Smaller models get the XL figures: asking for too much room only
unloads more of the host's models than needed, asking for too little can run out of memory.
The VAE's figures live in vae.py beside its tiling estimate.
"""

from __future__ import annotations

import torch

GIB = 2**30
MEGAPIXEL = 1024 * 1024

# T5-XXL while it encodes, bf16 compute: nf4/fp4 whole 2.62 GiB, nf4-recipe (wo in bf16) 4.01 GiB,
# unquantized bf16 9.01 GiB (measured). int8 is not measured: about a byte per parameter (4.8 B) plus the
# bf16 `wo` projections kept out of it (1.0 B parameters).
T5_BYTES = {
    "nf4": int(2.7 * GIB),
    "fp4": int(2.7 * GIB),
    "nf4-recipe": int(4.1 * GIB),
    "int8": int(6.5 * GIB),
    "none": int(9.1 * GIB),
}
# The XL transformer's 611 M parameters; qint8 and qfloat8 hold one byte each. Sampling adds about
# 0.3 GiB per megapixel and image (0.87 GiB peak with qint8 at 1024², 1.41 GiB in fp16).
TRANSFORMER_PARAMETERS = 611_000_000
TRANSFORMER_WORK_PER_MEGAPIXEL = int(0.3 * GIB)
QUANTIZED_BYTES_PER_PARAMETER = 1


# Low-VRAM mode (streaming.py) holds on the device the blocks in flight (the running one and the next)
# plus the small resident parts: measured T5 nf4 0.40 GiB, bf16 0.85 GiB; transformer qint8 0.33 GiB.
T5_LAYERS, TRANSFORMER_BLOCKS, BLOCKS_IN_FLIGHT = 24, 28, 2
T5_STREAMED_EXTRA = int(0.2 * GIB)  # quantization state, final norm, activations


def text_encoder(scheme: str, dtype: torch.dtype, low_vram: bool = False) -> tuple[int, int]:
    """(weights, work) of the T5 stage; the run itself is small next to the weights (300 tokens)."""
    weights = T5_BYTES.get(scheme, T5_BYTES["none"])
    if scheme == "none":
        weights = weights * dtype.itemsize // 2  # measured in bf16
    if low_vram:
        weights = weights * BLOCKS_IN_FLIGHT // T5_LAYERS + T5_STREAMED_EXTRA
    return weights, 0


def transformer(
    scheme: str, dtype: torch.dtype, latents: torch.Tensor, low_vram: bool = False
) -> tuple[int, int]:
    """(weights, work) of the sampler stage on ``latents`` ``[B, 4, h, w]`` (images of 8h × 8w)."""
    per_parameter = dtype.itemsize if scheme == "none" else QUANTIZED_BYTES_PER_PARAMETER
    batch, _, height, width = latents.shape
    work = TRANSFORMER_WORK_PER_MEGAPIXEL * batch * height * width * 64 // MEGAPIXEL
    weights = TRANSFORMER_PARAMETERS * per_parameter
    if low_vram:
        weights = weights * BLOCKS_IN_FLIGHT // TRANSFORMER_BLOCKS
    return weights, work
