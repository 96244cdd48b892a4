"""PixArt embeddings as ComfyUI core's CONDITIONING, in the form core's own PixArt T5 encoder makes it.

Core's PixArt text encoder (CLIPLoader type ``pixart``) hands the model every token of the prompt and
nothing more: no padding, no attention mask (its PixArt model takes none), ``pooled_output`` None. An
empty prompt is its end token alone. diffusers pads to 300 tokens and masks the padding out of the
cross-attention, which gives the same result: T5's own attention is masked the same way, so the
unpadded tokens' embeddings are those of the padded run, and attending to the masked tokens only is
attending to the unpadded ones. So the CONDITIONING is the embeddings cut to their mask's length.
"""

from __future__ import annotations

import torch

from .contract import PixArtEmbeds, check_embeds

# ComfyUI's CONDITIONING: a list of [embeddings [B, tokens, C], options] pairs.
Conditioning = list[list]


def _unpadded(embeds: torch.Tensor, mask: torch.Tensor) -> Conditioning:
    # Core computes in float32 and keeps conditioning on the CPU (its intermediate device).
    tokens = int(mask.sum(dim=1).max())
    return [[embeds[:, :tokens].to("cpu", torch.float32).contiguous(), {"pooled_output": None}]]


def core_conditioning(embeds: PixArtEmbeds) -> tuple[Conditioning, Conditioning]:
    """(positive, negative) CONDITIONING for core's PixArt-Σ model and KSampler: the prompt's and the
    negative's tokens without padding (a batch keeps the longest mask's length; one prompt per batch
    item gives the same length throughout)."""
    check_embeds(embeds)
    return (
        _unpadded(embeds.prompt_embeds, embeds.prompt_mask),
        _unpadded(embeds.negative_embeds, embeds.negative_mask),
    )
