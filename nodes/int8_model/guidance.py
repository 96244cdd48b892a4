"""Classifier-free guidance for PixArt-Σ under ComfyUI's samplers (KSampler and the rest) with the prompt and
the negative prompt in one batch: one call of the transformer a step instead of two.

ComfyUI runs the prompt and the negative prompt in one batch only when their conditioning concatenates:
PixArt's ``c_crossattn`` is a ``comfy.conds.CONDRegular``, which concatenates equal shapes only, and PixArt's
conditioning is not padded (a prompt is as many tokens as it has, an empty negative one), so every step runs
two batch-1 forwards. diffusers pads both texts to 300 tokens and masks the padding out of the
cross-attention; ComfyUI's PixArt (``comfy/ldm/pixart``, the same code in v0.3.64, v0.8.0 and v0.33.0) takes
no mask: ``PixArtMS.forward`` passes none (nor ``transformer_options``) on, ``MultiHeadCrossAttention``
asserts ``mask is None`` and calls ``optimized_attention`` without ``transformer_options``, so neither a
mask nor ``optimized_attention_override`` reaches its attention in any of these versions.

What is equivalent without a mask is ComfyUI's own padding for cross-attention, ``comfy.conds.CONDCrossAttn``:
each conditioning repeated to the least common multiple of their lengths. Attention over a sequence repeated
r times is attention over the sequence (each key's weight is divided by r and its value counted r times), so
the result is the two passes' up to rounding — unlike padding with zeros, whose keys would take part in the
softmax. ``CONDCrossAttn`` refuses padding beyond 4× the shorter length, which leaves out the common case (an
empty negative prompt is one token); :class:`PaddedCrossAttn` allows a common length up to the longer
conditioning or :data:`MAX_PADDED_TOKENS` (the 300 tokens diffusers gives each), and concatenates as
``CONDCrossAttn`` does. Lengths whose common multiple is longer (e.g. 299 and 300) stay two passes.

The hook is ``model_options["sampler_calc_cond_batch_function"]`` (``ModelPatcher.
set_model_sampler_calc_cond_batch_function``, in every version): :class:`BatchedGuidance` swaps each
conditioning's ``c_crossattn`` for a :class:`PaddedCrossAttn` holding the same tensor and hands the conds to
ComfyUI's own ``comfy.samplers.calc_cond_batch`` (or to the function set before it), which batches them as
it batches any conds, by its free-memory rule. Each conditioning is made ready once a run, its tensors on
the latents' device (ComfyUI would copy them there from pageable memory at every step), and let go at the
run's end. The pack's int8 MODEL carries it from its loader on; the Batched Guidance (PixArt-Σ) node sets it
on a clone of any PixArt-Σ MODEL, ComfyUI's own included."""

from __future__ import annotations

import copy
import math

import comfy.conds
import comfy.samplers
import torch
from comfy.patcher_extension import CallbacksMP

from ...core.single_files import CAPTION_TOKENS
from . import repeatable

CROSS_ATTN = "c_crossattn"
# The longest common length the conditionings are repeated to (unless the longer one is longer itself).
MAX_PADDED_TOKENS = CAPTION_TOKENS


def padded_length(first: int, second: int) -> int | None:
    """The length two conditionings of ``first`` and ``second`` tokens are repeated to for one batch, or
    None where that is longer than the longer one and :data:`MAX_PADDED_TOKENS`."""
    common_length = math.lcm(first, second)
    return common_length if common_length <= max(first, second, MAX_PADDED_TOKENS) else None


class PaddedCrossAttn(comfy.conds.CONDCrossAttn):
    """PixArt's cross-attention conditioning as ``CONDCrossAttn`` (repeated to a common length when
    concatenated) with :func:`padded_length`'s bound instead of its 4×."""

    def can_concat(self, other) -> bool:
        mine, theirs = self.cond.shape, other.cond.shape
        if mine == theirs:
            return comfy.conds.CONDRegular.can_concat(self, other)
        if not isinstance(other, comfy.conds.CONDCrossAttn) or mine[0] != theirs[0] or mine[2:] != theirs[2:]:
            return False
        return self.cond.device == other.cond.device and padded_length(mine[1], theirs[1]) is not None


def _padded(cond: dict, device: torch.device) -> dict:
    """A sampler conditioning (``model_conds`` and the rest) whose cross-attention batches by padding, its
    conditioning tensors on ``device`` (the latents')."""
    model_conds = {name: _on(value, device) for name, value in cond.get("model_conds", {}).items()}
    cross = model_conds.get(CROSS_ATTN)
    if type(cross) is comfy.conds.CONDRegular:  # PixArt's, not yet padded
        model_conds[CROSS_ATTN] = PaddedCrossAttn(cross.cond)
    return {**cond, "model_conds": model_conds}


def _on(value, device: torch.device):
    """A ``CONDRegular`` (or ``CONDCrossAttn``, ``PaddedCrossAttn``) with its tensor on ``device``; any other
    conditioning as it is."""
    moves = type(value) in (comfy.conds.CONDRegular, comfy.conds.CONDCrossAttn, PaddedCrossAttn)
    if not moves or not torch.is_tensor(value.cond) or value.cond.device == device:
        return value
    return type(value)(value.cond.to(device))


class BatchedGuidance:
    """``sampler_calc_cond_batch_function``: the conds with :class:`PaddedCrossAttn` cross-attention, to
    ``previous`` (a function set before this one) or ComfyUI's ``calc_cond_batch``.

    The conds of a run are the same objects at every step; each is made ready once (:func:`_padded`: its
    tensors moved to the latents' device, where ComfyUI would copy them there again at every step, from
    pageable memory, and repeat the shorter one to the common length on the CPU) and kept until the run's end
    (:func:`forget`, ComfyUI's ``ON_CLEANUP``)."""

    def __init__(self, previous=None):
        self.previous = previous
        self.ready: dict[int, tuple[dict, torch.device, dict]] = {}  # id(cond) -> (cond, device, made ready)

    def __deepcopy__(self, memo):  # ComfyUI's clone deep-copies model_options (v0.3.64, v0.8.0)
        return type(self)(copy.deepcopy(self.previous, memo))

    def prepared(self, cond: dict, device: torch.device, ready: dict) -> dict:
        entry = self.ready.get(id(cond))
        if entry is None or entry[0] is not cond or entry[1] != device:
            entry = (cond, device, _padded(cond, device))
        ready[id(cond)] = entry
        return entry[2]

    def __call__(self, args: dict) -> list:
        device, ready = args["input"].device, {}
        conds = [
            None if cond is None else [self.prepared(c, device, ready) for c in cond]
            for cond in args["conds"]
        ]
        self.ready = ready  # this step's conds only
        if self.previous is not None:
            return self.previous({**args, "conds": conds})
        return comfy.samplers.calc_cond_batch(
            args["model"], conds, args["input"], args["sigma"], args["model_options"]
        )


KEY = "sampler_calc_cond_batch_function"


def forget(patcher) -> None:
    """``ON_CLEANUP``: the run's conds made ready let go (their device copies freed)."""
    guidance = patcher.model_options.get(KEY)
    if isinstance(guidance, BatchedGuidance):
        guidance.ready = {}


def applied(patcher) -> bool:
    return (
        isinstance(patcher.model_options.get(KEY), BatchedGuidance)
        and forget in patcher.get_all_callbacks(CallbacksMP.ON_CLEANUP)
        and repeatable.applied(patcher)
    )


def apply(patcher) -> None:
    """Set :class:`BatchedGuidance` on ``patcher`` (once; a function set before it is kept behind it), and
    what makes a prompt repeat its image (:mod:`.repeatable`)."""
    if not isinstance(patcher.model_options.get(KEY), BatchedGuidance):
        patcher.set_model_sampler_calc_cond_batch_function(BatchedGuidance(patcher.model_options.get(KEY)))
    if forget not in patcher.get_all_callbacks(CallbacksMP.ON_CLEANUP):
        patcher.add_callback_with_key(CallbacksMP.ON_CLEANUP, repeatable.CALLBACK_KEY, forget)
    repeatable.apply(patcher)
