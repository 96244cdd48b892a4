"""LoRA during a run of the MODEL.

ComfyUI's LoRA loaders add their patches to the ModelPatcher as usual (``add_patches``, keyed by the layers'
``weight``). The weights are buffers of the pack's layers, which ComfyUI's loading moves but never rewrites,
so the int8 weights stay as they are; when a sampling run starts (``ON_PRE_RUN``) each layer with patches
gets them as its ``weight_patch``, added to the weight the layer expands anyway — plain LoRAs with one
multiply-add each (:class:`_Fold`), any other adapter through ``comfy.lora.calculate_weight``
(:class:`_Patches`) — which a layer computing in 8 bits quantizes again to its 8 bits
(:meth:`~...core.quant.quanto.ScaledWeightLinear.requantized`); the run's end (``ON_CLEANUP``) takes them off
(:class:`RunPatches`). Where the device has the room, a run holds the weights as the layers compute with
them, with their patches (expanded, or patched and quantized again), as the pack's sampler does."""

from __future__ import annotations

import dataclasses
import logging

import comfy.lora
import comfy.model_management
import torch

from ...core import estimates, measure, step_graph
from ...core.quant import compute as compute_paths
from ...core.quant import quanto
from ...core.transformer import TransformerSettings
from . import forward

logger = logging.getLogger(__name__)


class RunPatches:
    """What a sampling run of the MODEL adds to its layers and takes off after: the ModelPatcher's patches
    for each layer's weight, and the weights held as the layers compute with them where the device has the
    room (:func:`~...core.quant.quanto.hold_dense`). Its :meth:`start` is the MODEL's ``ON_PRE_RUN``
    callback, its :meth:`end` its ``ON_CLEANUP``.

    Plain LoRA patches (what ComfyUI's LoRA loaders make of a LoRA file) are read once per set of patches
    (ComfyUI's ``patches_uuid``) into factors in CPU memory, in the compute dtype, all of them in one
    page-locked block (:class:`_Factors`); each run copies that block to the device in one asynchronous
    copy and folds the factors into the expanded weights (:class:`_Fold`). Any other patch goes through
    ComfyUI's own ``calculate_weight``."""

    def __init__(self, transformer: TransformerSettings):
        self.scheme, self.dtype, self.native = transformer.scheme, transformer.dtype, transformer.native_size
        self.read: tuple[object, _Factors] | None = None

    def layers(self, patcher):
        prefix = "diffusion_model."
        for name, layer in patcher.model.diffusion_model.named_modules():
            if isinstance(layer, (quanto.ScaledWeightLinear, quanto.ScaledWeightConv2d)):
                yield f"{prefix}{name}.weight", layer

    def factors(self, patcher) -> _Factors:
        """Each patched layer's plain LoRAs as low-rank factors in CPU memory (None: a patch that is not a
        plain LoRA), read once for the patcher's set of patches."""
        if self.read is None or self.read[0] != patcher.patches_uuid:
            read = {}
            for key, layer in self.layers(patcher):
                patches = patcher.patches.get(key)
                if patches:
                    read[key] = _plain_loras(patches, layer.weight_scale.dtype)
            self.read = (patcher.patches_uuid, _Factors(read))
        return self.read[1]

    def start(self, patcher) -> None:
        device = patcher.load_device
        pack_forward = patcher.object_patches.get(forward.OBJECT)
        if isinstance(pack_forward, forward.PackForward):
            # A model ComfyUI loaded in part has layers cast in at each call: no graph over those.
            partly = getattr(patcher.model, "model_lowvram", False)
            pack_forward.begin(step_graph.wanted(device, pack_forward.compiled, partly, 0.0))
        factors = self.factors(patcher).on(device)
        for key, layer in self.layers(patcher):
            if key in factors and factors[key] is None:  # patches that are not plain LoRAs
                layer.weight_patch = _Patches(patcher.patches[key], key)
            elif factors.get(key):
                layer.weight_patch = _Fold(factors[key])
        carrying = sum(1 for branches in factors.values() if branches != ())
        if carrying:
            logger.info("PixArt-Σ MODEL: %d layers carry LoRA patches for this run", carrying)
        dense = quanto.dense_bytes(patcher.model)
        if device.type != "cuda" or not dense:
            return
        # The run's own work for a CFG batch at the native size, beside the held weights.
        run = estimates.transformer(self.scheme, self.dtype, 2, self.native**2)[1]
        free = comfy.model_management.get_free_memory(device)
        if dense + run <= free:
            quanto.hold_dense(patcher.model, device)
        else:
            logger.info(
                "PixArt-Σ MODEL: %s free on %s, under the held weights' %s and the run's %s: this run "
                "makes each layer's weights at every call",
                measure.format_bytes(free),
                device,
                measure.format_bytes(dense),
                measure.format_bytes(run),
            )

    def end(self, patcher) -> None:
        pack_forward = patcher.object_patches.get(forward.OBJECT)
        if isinstance(pack_forward, forward.PackForward):
            pack_forward.reset()  # its graphs first: they were captured over the held weights
        quanto.drop_dense(patcher.model)
        for _key, layer in self.layers(patcher):
            quanto.clear_run_patches(layer)


def _plain_lora(patch: tuple) -> bool:
    """Whether a ComfyUI patch ``(strength, adapter, strength_model, offset, function)`` is what ComfyUI's
    LoRA loaders make from a LoRA file: a ``LoRAAdapter`` of up, down and alpha alone, model strength 1, no
    function, rows (if any) along the output (the q, k and v LoRAs of the fused attention layer)."""
    from comfy.weight_adapter.lora import LoRAAdapter

    _strength, adapter, strength_model, offset, function = patch
    weights = getattr(adapter, "weights", None)
    return (
        isinstance(adapter, LoRAAdapter)
        and weights[3] is None  # LoCon's mid
        and weights[4] is None  # DoRA's scale
        and weights[5] is None  # reshape
        and strength_model == 1.0
        and function is None
        and (offset is None or offset[0] == 0)
    )


def _plain_loras(patches: list, dtype: torch.dtype) -> tuple[compute_paths.LowRank, ...] | None:
    """A layer's ComfyUI patches as low-rank factors when every one is a plain LoRA (:func:`_plain_lora`),
    each its rows from the offset ComfyUI's key map gives; the factors in ``dtype``. None when a patch is of
    another kind (LoHa, LoKr, DoRA, LoCon's mid, a model strength other than 1). A patch of strength 0
    changes nothing and is left out, as the sampler leaves out a LoRA of strength 0: the layer then runs as
    without it (the same compiled graph, so the same bits)."""
    if not all(_plain_lora(patch) for patch in patches):
        return None
    branches = []
    for strength, adapter, _strength_model, offset, _function in patches:
        if strength == 0:
            continue
        up, down, alpha = adapter.weights[:3]
        scale = strength * (1.0 if alpha is None else float(alpha) / down.shape[0])
        rows = None if offset is None else (int(offset[1]), int(offset[2]))
        up, down = (t.to(dtype).flatten(1) for t in (up, down))
        branches.append(compute_paths.LowRank(up, down, scale, rows))
    return tuple(branches)


class _Factors(dict):
    """A set of patches' plain LoRAs (layer key -> its factors, or None for a layer with another kind of
    patch; :func:`_plain_loras`), every tensor a view of one block of CPU memory (:class:`_Block`),
    page-locked where CUDA is. :meth:`on` puts them on a device with one copy, where a copy a factor was two
    a LoRA and layer (560 for a LoRA on every attention and feed-forward layer of PixArt-Σ, each with its
    own launch)."""

    def __init__(self, read: dict[str, tuple[compute_paths.LowRank, ...] | None]):
        tensors = [
            t for branches in read.values() for branch in branches or () for t in (branch.up, branch.down)
        ]
        self.block = _Block(tensors, pinned=torch.cuda.is_available())
        super().__init__(_with_tensors(read, self.block.views(self.block.memory)))

    def on(self, device: torch.device) -> dict[str, tuple[compute_paths.LowRank, ...] | None]:
        """The same values with their tensors on ``device`` (asynchronously from page-locked memory)."""
        there = self.block.memory.to(device, non_blocking=self.block.pinned)
        return dict(_with_tensors(self, self.block.views(there)))


def _with_tensors(read: dict, tensors: list[torch.Tensor]):
    """``read``'s keys and values, each LoRA's ``up`` and ``down`` taken in turn from ``tensors``."""
    taken = iter(tensors)
    for key, branches in read.items():
        if branches is None:
            yield key, None
            continue
        yield key, tuple(dataclasses.replace(b, up=next(taken), down=next(taken)) for b in branches)


class _Block:
    """One block of CPU memory holding copies of ``tensors`` one after another, each at an offset aligned for
    any dtype (page-locked when ``pinned``), so that they move to a device in one copy and are views of one
    block there (:meth:`views`)."""

    ALIGN = 64

    def __init__(self, tensors: list[torch.Tensor], pinned: bool):
        self.pinned = pinned
        self.layout, size = [], 0
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            self.layout.append((size, nbytes, tensor.dtype, tensor.shape))
            size += -(-nbytes // self.ALIGN) * self.ALIGN
        self.memory = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        for tensor, view in zip(tensors, self.views(self.memory), strict=True):
            view.copy_(tensor)

    def views(self, memory: torch.Tensor) -> list[torch.Tensor]:
        """The tensors as views of ``memory`` (this block, or a copy of it on a device)."""
        return [
            memory[offset : offset + nbytes].view(dtype).view(shape)
            for offset, nbytes, dtype, shape in self.layout
        ]


class _Fold:
    """A layer's plain LoRAs as its ``weight_patch``: each added in place to the expanded weight's rows
    (:meth:`~...core.quant.compute.LowRank.fold_into`: one multiply-add a LoRA, no full-size temporaries),
    the sum ComfyUI's ``calculate_weight`` makes of them, rounded once instead of twice."""

    def __init__(self, branches: tuple[compute_paths.LowRank, ...]):
        self.branches = branches

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        for branch in self.branches:
            branch.fold_into(weight)
        return weight


class _Patches:
    """A layer's ComfyUI patches as its ``weight_patch``: added to the expanded weight as ComfyUI adds them
    to any weight (``comfy.lora.calculate_weight``, which narrows to a fused layer's rows by itself)."""

    def __init__(self, patches: list, key: str):
        self.patches, self.key = patches, key

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        return comfy.lora.calculate_weight(self.patches, weight, self.key)
