"""The 8-bit inputs of a PixArt-Σ block's linear layers, each made in one pass with the op before it: eager
float32 references of the pack's kernels (:mod:`.fused_kernels`), which run on any device.

- :func:`quantize_rows`: a plain per-row quantization (the attention's output projection, the
  cross-attention's query), :mod:`.compute`'s own.
- :func:`norm_modulate_quantize`: LayerNorm without affine (the block's ``norm1``, ``norm2``), PixArt's
  modulation ``x × (1 + scale) + shift`` (one shift and scale a batch item: ``ada_norm_single``), then the
  per-row quantization (the q, k, v and first feed-forward inputs).
- :func:`gelu_quantize`: GELU's tanh approximation (PixArt's feed-forward, ``gelu-approximate``), then the
  per-row quantization (the second feed-forward input).

Each quantizes as :func:`.compute.quantize_float32` does: a row's scale is its absmax over 127 (int8,
rounded half to even) or 448 (e4m3). Only the 8-bit values leave the pass: a layer that needs the
unquantized input takes the unfused path (:mod:`.block`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .compute import Rows, quantize_float32, quantize_rows

__all__ = ["Rows", "gelu_quantize", "modulation_rows", "norm_modulate_quantize", "quantize_rows"]


def norm_modulate_quantize(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, compute: str
) -> Rows:
    """``x`` ``[B, N, K]`` layer-normed over ``K`` (no affine), modulated by its batch item's ``shift`` and
    ``scale`` (``[B, 1, K]``, or ``[1, 1, K]`` for all), quantized per row to ``compute``'s 8 bits."""
    shift, scale = modulation_rows(x, shift, "shift"), modulation_rows(x, scale, "scale")
    normed = F.layer_norm(x.float(), x.shape[-1:], eps=eps)
    modulated = normed * (1 + scale.float()[:, None]) + shift.float()[:, None]
    return quantize_float32(modulated.reshape(-1, x.shape[-1]), compute, tuple(x.shape[:-1]))


def gelu_quantize(x: torch.Tensor, compute: str) -> Rows:
    """GELU (tanh approximation) of ``x`` ``[..., K]``, quantized per row to ``compute``'s 8 bits."""
    rows = F.gelu(x.reshape(-1, x.shape[-1]).float(), approximate="tanh")
    return quantize_float32(rows, compute, tuple(x.shape[:-1]))


def modulation_rows(x: torch.Tensor, modulation: torch.Tensor, name: str) -> torch.Tensor:
    """A shift or scale for ``x`` ``[B, N, K]`` as ``[B, K]`` or ``[1, K]`` rows; one clear line otherwise."""
    batch, width = x.shape[0], x.shape[-1]
    if x.dim() != 3 or modulation.shape[-1] != width or modulation.numel() not in (width, batch * width):
        raise ValueError(
            f"{name} of shape {tuple(modulation.shape)} does not modulate x of shape {tuple(x.shape)}; give x "
            f"as [B, N, K] and {name} as [B, 1, K] (one a batch item) or [1, 1, K]."
        )
    return modulation.reshape(-1, width)
