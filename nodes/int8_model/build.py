"""The MODEL built: ComfyUI builds the model (its own PixArt-Σ, ``comfy/ldm/pixart``) through its own model
config and loader steps, with the pack's layers as its custom operations (:class:`Int8Ops`): every linear
and convolution layer is the pack's :class:`~...core.quant.quanto.ScaledWeightLinear` /
``ScaledWeightConv2d`` (the layers the Quanto PixArt Sampler runs), holding the int8 (or float8) weights and
their per-row scales. The result is a plain ``ModelPatcher``: ComfyUI's model management loads, offloads
and frees it, and core's samplers and model patches take it as any MODEL. :func:`load` gives it the rest of
the package's jobs: its forward, batched guidance, LoRA during a run and where its weights wait between
runs.

ComfyUI's model detection assumes PixArt-Σ's published sizes; the config here comes from the transformer's
own (:func:`unet_config`), so every PixArt-Σ-architecture model the pack reads works, the tiny test models
too.
"""

from __future__ import annotations

import logging

import comfy.model_detection
import comfy.model_management
import comfy.model_patcher
import comfy.ops
import comfy.utils
import torch
from comfy.patcher_extension import CallbacksMP, WrappersMP

from ...core import measure
from ...core.quant import block as fused_block
from ...core.quant import compute as compute_paths
from ...core.quant import quanto
from ...core.single_files import CAPTION_TOKENS
from ...core.transformer import TransformerSettings, quantized_transformer
from . import forward, guidance
from .lora import RunPatches
from .residence import HostCopies, release_after

logger = logging.getLogger(__name__)

CALLBACK_KEY = "pixart_lowvram_int8"
META = torch.device("meta")
# diffusers' keys of the transformer that ComfyUI's PixArt computes instead of reading.
COMPUTED = ("pos_embed.pos_embed",)
BLOCKS = "blocks."  # ComfyUI's PixArt's transformer blocks: the layers an 8-bit compute runs


def _load_scaled(layer, state_dict, prefix, missing_keys, unexpected_keys, dtype):
    """Take the layer's tensors from ComfyUI's state dict as they are (no copy into the placeholders):
    ``weight`` (int8, float8, or a float weight of a layer left unquantized), its ``weight_scale`` (ones for
    an unquantized one, so every layer expands the same way) and ``bias``; scales and floats in ``dtype``."""
    weight = state_dict.get(prefix + "weight")
    if weight is None:
        missing_keys.append(prefix + "weight")
        return
    scale = state_dict.get(prefix + "weight_scale")
    if scale is None:
        scale = torch.ones((weight.shape[0],) + (1,) * (weight.dim() - 1), dtype=dtype)
        weight = weight.to(dtype)
    layer.weight = weight
    layer.weight_scale = scale.to(dtype)
    bias = state_dict.get(prefix + "bias")
    if layer.has_bias:
        if bias is None:
            missing_keys.append(prefix + "bias")
        else:
            layer.bias = torch.nn.Parameter(bias.to(dtype), requires_grad=False)
    known = {prefix + name for name in ("weight", "weight_scale", "bias")}
    unexpected_keys.extend(
        key
        for key in state_dict
        if key.startswith(prefix) and key not in known and "." not in key[len(prefix) :]
    )


def _unset(layer, bias: bool) -> None:
    """Leave the layer's tensors unset until its weights are loaded: ComfyUI records each tensor's dtype as it
    builds a model (Dynamic VRAM casts to that dtype when it loads), and a placeholder's dtype would be a
    guess — int8 for a layer that turns out unquantized (``proj_out``) or float8 (qfloat8)."""
    layer.weight = layer.weight_scale = layer.bias = None
    layer.has_bias = bias


class Int8Ops(comfy.ops.manual_cast):
    """ComfyUI's operations with the pack's layers as its linear and 2-D convolution layers, their 8-bit
    weights with host copies in CPU memory (:class:`~.residence.HostCopies`)."""

    class Linear(HostCopies, quanto.ScaledWeightLinear):
        def __init__(self, in_features, out_features, bias=True, dtype=None, device=None):
            self.compute_dtype = dtype or torch.float32
            super().__init__(
                torch.empty(out_features, in_features, dtype=torch.int8, device=META),
                torch.empty(out_features, 1, dtype=self.compute_dtype, device=META),
                None,
            )
            _unset(self, bias)

        def _load_from_state_dict(self, state_dict, prefix, _metadata, _strict, missing, unexpected, _errors):
            _load_scaled(self, state_dict, prefix, missing, unexpected, self.compute_dtype)

    class Conv2d(HostCopies, quanto.ScaledWeightConv2d):
        def __init__(
            self,
            in_channels,
            out_channels,
            kernel_size,
            stride=1,
            padding=0,
            dilation=1,
            groups=1,
            bias=True,
            padding_mode="zeros",
            dtype=None,
            device=None,
        ):
            if padding_mode != "zeros":
                raise TypeError(f"a {padding_mode!r}-padded convolution is not one the pack's MODEL runs")
            self.compute_dtype = dtype or torch.float32
            size = torch.nn.modules.utils._pair(kernel_size)
            super().__init__(
                torch.empty(out_channels, in_channels // groups, *size, dtype=torch.int8, device=META),
                torch.empty(out_channels, 1, 1, 1, dtype=self.compute_dtype, device=META),
                None,
                torch.nn.modules.utils._pair(stride),
                torch.nn.modules.utils._pair(padding),
                torch.nn.modules.utils._pair(dilation),
                groups,
            )
            _unset(self, bias)

        def _load_from_state_dict(self, state_dict, prefix, _metadata, _strict, missing, unexpected, _errors):
            _load_scaled(self, state_dict, prefix, missing, unexpected, self.compute_dtype)


def unet_config(config: dict, state: dict[str, torch.Tensor]) -> dict:
    """ComfyUI's PixArt config (``PixArtMS``'s arguments) for a diffusers transformer config and its
    weights (diffusers' keys)."""
    heads, hidden = (
        config["num_attention_heads"],
        config["num_attention_heads"] * config["attention_head_dim"],
    )
    in_channels = config.get("in_channels", 4)
    out_channels = config.get("out_channels") or in_channels
    sample_size = config.get("sample_size", 128)
    alpha = "adaln_single.emb.resolution_embedder.linear_1.weight" in state
    return {
        "image_model": "pixart_alpha" if alpha else "pixart_sigma",
        "micro_condition": alpha,
        "patch_size": config.get("patch_size", 2),
        "in_channels": in_channels,
        "pred_sigma": out_channels == 2 * in_channels,
        "learn_sigma": out_channels == 2 * in_channels,
        "hidden_size": hidden,
        "num_heads": heads,
        "depth": config["num_layers"],
        "mlp_ratio": state["transformer_blocks.0.ff.net.0.proj.weight"].shape[0] / hidden,
        "caption_channels": config.get("caption_channels", 4096),
        "model_max_length": CAPTION_TOKENS,
        "input_size": sample_size,
        # diffusers' position embedding scale, fixed as diffusers fixes it (ComfyUI's default works it out
        # from the image size: the same at the native size, and 0 for a model smaller than 512 px).
        "pe_interpolation": config.get("interpolation_scale") or max(sample_size // 64, 1),
    }


def comfy_state(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The transformer's tensors (diffusers' keys, quantized layers as ``weight`` and ``weight_scale``)
    under ComfyUI's PixArt keys, through ComfyUI's own key map (``comfy.utils.pixart_to_diffusers``): the
    separate q, k, v (and k, v) projections become its fused ones, rows stacked at the map's offsets."""
    key_map = comfy.utils.pixart_to_diffusers(config)
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    unmapped = []
    for key, tensor in state.items():
        stem, suffix = (key[: -len("_scale")], "_scale") if key.endswith(".weight_scale") else (key, "")
        target = key_map.get(stem)
        if target is None:
            if key not in COMPUTED:
                unmapped.append(key)
            continue
        name, offset = (target, None) if isinstance(target, str) else target
        if offset is not None and offset[0] != 0:
            raise ValueError(f"{key}: ComfyUI's map joins it along dimension {offset[0]}, not its rows")
        pieces.setdefault(name + suffix, []).append((0 if offset is None else offset[1], tensor))
    # The learned empty caption of original checkpoints, for dropout in training: diffusers keeps none, and
    # ComfyUI's PixArt reads only its length.
    caption = state["caption_projection.linear_1.weight"]
    pieces["y_embedder.y_embedding"] = [
        (0, torch.zeros(CAPTION_TOKENS, caption.shape[1], dtype=caption.dtype))
    ]
    if unmapped:
        raise ValueError(
            f"the transformer has weights ComfyUI's PixArt has no place for ({', '.join(unmapped[:5])}); it is "
            "not a PixArt-Σ transformer the pack's MODEL can hold."
        )
    return {
        name: parts[0][1] if len(parts) == 1 else torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])])
        for name, parts in pieces.items()
    }


def load(
    transformer: TransformerSettings, keep_loaded: bool, disable_dynamic: bool = True
) -> comfy.model_patcher.ModelPatcher:
    """The transformer of ``transformer`` (its model folder or file, scheme and quantized cache) as a ComfyUI
    MODEL holding its quantized weights, computing its forward with diffusers' blocks (:mod:`.forward`,
    compiled for an 8-bit compute on a GPU), batching its guidance (:mod:`.guidance`), adding LoRA patches
    during a run (:mod:`.lora`) and refusing images too small for ComfyUI's PixArt before sampling
    (:func:`refuse_small`). Without ``keep_loaded`` ComfyUI unloads it after each run
    (:func:`~.residence.release_after`), its layers' tensors waiting in their page-locked host copies
    (:class:`~.residence.HostCopies`).

    A plain ``ModelPatcher``, also where Dynamic VRAM makes ``CoreModelPatcher`` its own (v0.33): Dynamic
    VRAM streams ComfyUI's cast operations only, and loads every other layer whole from the backups it keeps
    in host memory on each load — every sampling run, since a dynamic model is prepared anew each time — so
    under it the pack's int8 buffers were copied to the device again on every prompt. A plain patcher leaves
    a loaded MODEL loaded. (``disable_dynamic``, which ComfyUI's ``clone`` passes to a loader's factory,
    changes nothing here for that reason.)

    The patcher's ``cached_patcher_init`` is this function with its arguments, as ComfyUI's own loaders set
    theirs: ComfyUI's ``deepclone_multigpu`` (MultiGPU CFG Split) builds a fresh MODEL for another device
    from it."""
    quantized = quantized_transformer(transformer)
    state = {key: tensor.detach() for key, tensor in quantized.state_dict().items()}
    config = unet_config(transformer.config, state)
    del quantized
    state = comfy_state(state, config)
    # The blocks' 8-bit weights in the form their compute takes, before ComfyUI builds the model and records
    # its tensors' dtypes (Dynamic VRAM loads each tensor as what it recorded).
    for key, tensor in state.items():
        if key.startswith(BLOCKS) and key.endswith(".weight") and key + "_scale" in state:
            state[key] = compute_paths.weight_for(transformer.compute, tensor)
    model_config = comfy.model_detection.model_config_from_unet_config(config, state)
    if model_config is None:
        raise ValueError(f"ComfyUI has no model for the config {config}; it is not a PixArt model")
    load_device = comfy.model_management.get_torch_device()
    offload_device = comfy.model_management.unet_offload_device()
    supported = model_config.supported_inference_dtypes
    dtype = comfy.model_management.unet_dtype(
        load_device, sum(t.numel() for t in state.values()), supported, weight_dtype=transformer.dtype
    )
    model_config.set_inference_dtype(
        dtype, comfy.model_management.unet_manual_cast(dtype, load_device, supported)
    )
    model_config.custom_operations = Int8Ops
    model = model_config.get_model(state, "")
    model.load_model_weights(state, "")
    blocks = model.diffusion_model.blocks
    quanto.set_compute(blocks, transformer.compute)
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=load_device, offload_device=offload_device)
    patcher.cached_patcher_init = (load, (transformer, keep_loaded))
    guidance.apply(patcher)
    patcher.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, CALLBACK_KEY, refuse_small)
    # diffusers' blocks over the MODEL's own layers (ComfyUI's forward where they would differ), quantizing
    # each 8-bit layer's input with the op before it and compiled as the sampler's blocks are.
    pack_forward = forward.PackForward(
        model.diffusion_model,
        transformer.config,
        config,
        transformer.compute,
        compiled=transformer.compiled and load_device.type == "cuda",
        fused=fused_block.fused(transformer.compute, load_device),
    )
    patcher.add_object_patch(forward.OBJECT, pack_forward)
    patcher.add_callback_with_key(CallbacksMP.ON_CLONE, CALLBACK_KEY, pack_forward.follow)
    run = RunPatches(transformer)
    patcher.add_callback_with_key(CallbacksMP.ON_PRE_RUN, CALLBACK_KEY, run.start)
    patcher.add_callback_with_key(CallbacksMP.ON_CLEANUP, CALLBACK_KEY, run.end)
    if not keep_loaded:
        patcher.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, CALLBACK_KEY, release_after)
    logger.info(
        "PixArt-Σ %s MODEL: %s of weights, %d layers quantized",
        transformer.scheme.describe(),
        measure.format_bytes(patcher.model_size()),
        sum(isinstance(m, quanto.ScaledWeightLinear) for m in model.modules()),
    )
    return patcher


# ComfyUI's PixArt places its position embedding with ``base_size = round(side / 64) * 64 // patch_size``
# (``side``: the latent's mean side), 0 (a division by zero) up to a mean side of 32 latent pixels.
SMALLEST_MEAN_SIDE = 33
LATENT_PIXELS = 8  # image pixels per latent pixel (the SDXL VAE)


def refuse_small(executor, noise, latent_image, *args, **kwargs):
    """``OUTER_SAMPLE`` wrapper: a latent too small for ComfyUI's PixArt refused before sampling."""
    height, width = latent_image.shape[-2:]
    if (height + width) // 2 < SMALLEST_MEAN_SIDE:
        smallest = SMALLEST_MEAN_SIDE * LATENT_PIXELS
        square = -(-smallest // 16) * 16  # the smallest square with even latent sides
        raise ValueError(
            f"latent_image: {width * LATENT_PIXELS}×{height * LATENT_PIXELS} is too small for ComfyUI's PixArt-Σ "
            f"(the mean of width and height must be at least {smallest} px); make it at least {square}×{square}, "
            "or use the Quanto PixArt Sampler, which makes smaller images."
        )
    return executor(noise, latent_image, *args, **kwargs)
