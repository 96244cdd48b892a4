"""PixArt-Σ's transformer blocks with each 8-bit layer's input quantized by the op that makes it.

:func:`fused_forward` is diffusers' ``BasicTransformerBlock.forward`` for PixArt's blocks
(``ada_norm_single``: a shift, scale and gate for the attention and the feed-forward, made from the
timestep and the block's ``scale_shift_table``), with the 8-bit inputs made by :mod:`.fused_kernels`:

- the self-attention's q, k and v (one quantized input for the three, or for ComfyUI's fused ``to_qkv``):
  ``norm1`` + ``shift_msa``/``scale_msa`` (:func:`~.fused_kernels.norm_modulate_quantize`);
- the first feed-forward layer (``ff.net[0].proj``): ``norm2`` + ``shift_mlp``/``scale_mlp``;
- the second (``ff.net[2]``): the GELU (:func:`~.fused_kernels.gelu_quantize`);
- the attentions' output projections (``to_out[0]``) and the cross-attention's query: a plain per-row
  quantization (:func:`~.fused_kernels.quantize_rows`).

An input goes to its layers unquantized, by their present path, when any of them does not take it
quantized (:meth:`.quanto.ScaledWeightLinear.takes_rows`: :data:`.compute.MIN_ROWS` rows or fewer, fp16
compute); so do the cross-attention's keys and values (the caption's rows). A layer with a LoRA takes
the quantized input as without one (the LoRA is in its 8-bit weight). The attention is
``AttnProcessor2_0``'s (``FusedAttnProcessor2_0``'s over fused projections). The norm and modulation run
in float32 where diffusers' run in the activation's dtype: the same image within the 8-bit rounding.
"""

from __future__ import annotations

import os
import types

import torch

from .. import attention
from . import fused_kernels
from .compute import FP16, Rows
from .quanto import ScaledWeightLinear

# diffusers' processors and the pack's own (:class:`..attention.Processor`), whose attention it runs.
PROCESSORS = ("AttnProcessor2_0", "FusedAttnProcessor2_0", "Processor")


# Unset, the blocks run fused where the kernels run: on CUDA with Triton (elsewhere the ops are their
# references, which save nothing). 1 or 0 says so everywhere (docs/DESIGN.md, Decisions).
VARIABLE = "PIXART_LOWVRAM_FUSED_QUANT"


def wanted(device: torch.device | str) -> bool:
    """Whether 8-bit blocks on ``device`` run fused: ``PIXART_LOWVRAM_FUSED_QUANT`` ``1`` or ``0`` says; unset,
    where the kernels run (a CUDA device, Triton installed)."""
    value = os.environ.get(VARIABLE, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(
            f"{VARIABLE}={value!r} is not a setting; set it to 1 (the fused quantization kernels), 0 "
            "(each layer quantizes its own input) or unset it (fused on CUDA where Triton is installed)."
        )
    if value:
        return value == "1"
    return fused_kernels.triton is not None and torch.device(device).type == "cuda"


def fused(compute: str, device: torch.device | str) -> bool:
    """Whether blocks computing ``compute`` on ``device`` run fused: an 8-bit compute, where :func:`wanted`
    says so. The one place the sampler and the int8 MODEL ask."""
    return compute != FP16 and wanted(device)


def use_fused(blocks: torch.nn.ModuleList, compute: str) -> int:
    """Every block of ``blocks`` runs :func:`fused_forward` when ``compute`` is an 8-bit one; returns how
    many. Before the blocks are compiled (``torch.compile`` wraps the forward it finds)."""
    if compute == FP16:
        return 0
    for index, block in enumerate(blocks):
        problem = unfusable(block)
        if problem is not None:
            raise TypeError(f"block {index} is {problem}: not a PixArt-Σ block; set compute to fp16.")
    for block in blocks:
        block.forward = types.MethodType(fused_forward, block)
    return len(blocks)


def unuse_fused(blocks: torch.nn.ModuleList) -> None:
    """The blocks run their class's forward again."""
    for block in blocks:
        if getattr(block.forward, "__func__", None) is fused_forward:
            del block.forward


def unfusable(block: torch.nn.Module) -> str | None:
    """What makes ``block`` other than the PixArt-Σ block :func:`fused_forward` computes; None if nothing."""
    from diffusers.models.activations import GELU
    from diffusers.models.attention import BasicTransformerBlock

    if not isinstance(block, BasicTransformerBlock) or block.norm_type != "ada_norm_single":
        return f"a {type(block).__name__} without ada_norm_single modulation"
    if block.attn2 is None or block.only_cross_attention or block.pos_embed is not None:
        return "a block without PixArt's self- then cross-attention"
    if any(norm.weight is not None for norm in (block.norm1, block.norm2)):
        return "a block whose norms have weights"
    ff = block.ff.net
    if len(ff) != 3 or not isinstance(ff[0], GELU) or ff[0].approximate != "tanh":
        return "a block whose feed-forward is not GELU (tanh)"
    if any(module.p for module in block.modules() if isinstance(module, torch.nn.Dropout)):
        return "a block with dropout"
    for attn in (block.attn1, block.attn2):
        processor = type(attn.processor).__name__
        if processor not in PROCESSORS:
            return f"a block whose attention runs {processor}"
        if attention.unsupported(attn) is not None:
            return "a block whose attention normalizes, adds or rescales"
    return None


def fused_forward(
    block,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    encoder_hidden_states: torch.Tensor | None = None,
    encoder_attention_mask: torch.Tensor | None = None,
    timestep: torch.Tensor | None = None,
    cross_attention_kwargs: dict | None = None,
    class_labels: torch.Tensor | None = None,
    added_cond_kwargs: dict | None = None,
) -> torch.Tensor:
    """``BasicTransformerBlock.forward`` of a PixArt-Σ block, each 8-bit input quantized in one pass with
    the op before it (diffusers' own forward for a chunked feed-forward or attention arguments)."""
    if cross_attention_kwargs or block._chunk_size is not None:
        return type(block).forward(
            block, hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask, timestep,
            cross_attention_kwargs, class_labels, added_cond_kwargs,
        )  # fmt: skip
    batch, dtype = hidden_states.shape[0], hidden_states.dtype
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
        block.scale_shift_table[None] + timestep.reshape(batch, 6, -1)
    ).chunk(6, dim=1)
    attn1, attn2, ff = block.attn1, block.attn2, block.ff.net

    x = _modulated(block.norm1, hidden_states, shift_msa, scale_msa, _qkv_layers(attn1))
    hidden_states = gate_msa * _self_attention(attn1, x, attention_mask, dtype) + hidden_states
    query = _quantized(hidden_states, [attn2.to_q])
    context = encoder_hidden_states
    hidden_states = _cross_attention(attn2, query, context, encoder_attention_mask, dtype) + hidden_states
    x = _modulated(block.norm2, hidden_states, shift_mlp, scale_mlp, [ff[0].proj])
    return gate_mlp * _feed_forward(ff, x, dtype) + hidden_states


def _compute_for(layers, rows: int) -> str | None:
    """The 8-bit compute in which every layer of ``layers`` takes its ``rows``-row input quantized ahead;
    None when one of them takes it unquantized."""
    computes = {
        layer.compute if isinstance(layer, ScaledWeightLinear) and layer.takes_rows(rows) else None
        for layer in layers
    }
    return computes.pop() if len(computes) == 1 else None


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


def _modulated(norm, x, shift, scale, layers) -> torch.Tensor | Rows:
    compute = _compute_for(layers, _rows(x))
    if compute is None:
        return norm(x) * (1 + scale) + shift
    return fused_kernels.norm_modulate_quantize(x, shift, scale, norm.eps, compute)


def _quantized(x: torch.Tensor, layers) -> torch.Tensor | Rows:
    compute = _compute_for(layers, _rows(x))
    return x if compute is None else fused_kernels.quantize_rows(x, compute)


def _apply(layer, input: torch.Tensor | Rows, dtype: torch.dtype) -> torch.Tensor:
    return layer.product(input, dtype) if isinstance(input, Rows) else layer(input)


def _fused_projections(attn) -> bool:
    return hasattr(attn, "to_qkv")


def _qkv_layers(attn) -> tuple:
    return (attn.to_qkv,) if _fused_projections(attn) else (attn.to_q, attn.to_k, attn.to_v)


def _self_attention(attn, input, mask, dtype) -> torch.Tensor:
    if _fused_projections(attn):
        q, k, v = _apply(attn.to_qkv, input, dtype).chunk(3, dim=-1)
    else:
        q, k, v = (_apply(layer, input, dtype) for layer in (attn.to_q, attn.to_k, attn.to_v))
    return _output(attn, attention.attend_heads(attn, "self", q, k, v, mask), dtype)


def _cross_attention(attn, query, context, mask, dtype) -> torch.Tensor:
    q = _apply(attn.to_q, query, dtype)
    if hasattr(attn, "to_kv"):
        k, v = attn.to_kv(context).chunk(2, dim=-1)
    else:
        k, v = attn.to_k(context), attn.to_v(context)
    return _output(attn, attention.attend_heads(attn, "cross", q, k, v, mask), dtype)


def _output(attn, x, dtype) -> torch.Tensor:
    return _apply(attn.to_out[0], _quantized(x, [attn.to_out[0]]), dtype)


def _feed_forward(ff, input, dtype) -> torch.Tensor:
    gelu, second = ff[0], ff[2]
    hidden = _apply(gelu.proj, input, dtype)
    compute = _compute_for([second], _rows(hidden))
    x = gelu.gelu(hidden) if compute is None else fused_kernels.gelu_quantize(hidden, compute)
    return _apply(second, x, dtype)
