"""The pack's int8 transformer as one of ComfyUI's own MODELs.

ComfyUI builds the model (its own PixArt-Σ, ``comfy/ldm/pixart``) through its own model config and loader
steps, with the pack's layers as its custom operations: every linear and convolution layer is the pack's
:class:`~..core.quant.quanto.ScaledWeightLinear` / ``ScaledWeightConv2d`` (the layers the Quanto PixArt
Sampler runs), holding the int8 (or float8) weights and their per-row scales. The result is a plain
``ModelPatcher``: ComfyUI's model management loads, offloads and frees it, and core's samplers and model
patches take it as any MODEL.

LoRA: ComfyUI's LoRA loaders add their patches to the ModelPatcher as usual (``add_patches``, keyed by the
layers' ``weight``). The weights are buffers of the pack's layers, which ComfyUI's loading moves but never
rewrites, so the int8 weights stay as they are; when a sampling run starts (``ON_PRE_RUN``) each layer with
patches gets them as its ``weight_patch``, added to the weight the layer expands anyway — plain LoRAs with
one multiply-add each (:class:`_Fold`), any other adapter through ``comfy.lora.calculate_weight`` — and the
run's end (``ON_CLEANUP``) takes them off. Where the device has the room, a run holds the weights expanded,
with their patches, as the pack's sampler does.

The forward is diffusers' over these layers (:mod:`.pack_forward`, an object patch). Without ``keep_loaded``
ComfyUI unloads the MODEL after each run (:func:`release_after`), its layers' tensors waiting in page-locked
homes in CPU memory (:class:`_HomeCopies`).

ComfyUI's model detection assumes PixArt-Σ's published sizes; the config here comes from the transformer's
own (``unet_config``), so every PixArt-Σ-architecture model the pack reads works, the tiny test models too.
"""

from __future__ import annotations

import logging
import threading
import weakref

import comfy.lora
import comfy.model_detection
import comfy.model_management
import comfy.model_patcher
import comfy.ops
import comfy.utils
import torch
from comfy.patcher_extension import CallbacksMP, WrappersMP

from ..core import estimates, measure
from ..core import sampler as sampler_stage
from ..core.quant import compute as compute_paths
from ..core.quant import quanto
from ..core.single_files import CAPTION_TOKENS
from ..core.transformer import TransformerSettings, quantized_transformer
from . import batched_guidance, comfy_models, pack_forward

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


class _HomeCopies:
    """A layer of the MODEL whose tensors (its 8-bit weight, scales and bias) keep a home in CPU memory,
    page-locked. ComfyUI moves the MODEL with ``Module.to`` (its load, and its unload to the offload device):
    here moving a layer off the CPU copies each tensor from its home (asynchronously: a home never changes)
    and keeps the home; moving it back puts the home in place. Nothing is copied back, since the weights
    never change (LoRA patches are added at run time, and a patch ComfyUI writes into a bias is undone before
    it unloads). So a MODEL that leaves the GPU between prompts (``keep_loaded`` off) costs one copy at full
    speed a prompt, not ComfyUI's copy to fresh pageable memory and back. A tensor that is not the one made
    from its home (another dtype, one ComfyUI put in its place) moves as torch moves it. The device copy is
    known by a weak reference, so the home holds no device memory."""

    HOMED = (("_buffers", "weight"), ("_buffers", "weight_scale"), ("_parameters", "bias"))

    def _apply(self, fn, recurse=True):
        homes = self.__dict__.setdefault("_homes", {})
        for kind, name in self.HOMED:
            tensor = getattr(self, kind).get(name)
            if tensor is None:
                continue
            target = _placement(fn, tensor)
            if target is None or target[1] != tensor.dtype or target[0] == tensor.device:
                continue
            device = target[0]
            home, made, address, pinned = homes.get(name, (None, None, None, False))
            if device.type == "cpu":
                if home is not None and made() is tensor and tensor.data_ptr() == address:
                    self._place(kind, name, home)
            elif tensor.device.type == "cpu":
                if not _is_home(tensor, home):  # a tensor of its own (the first move, or ComfyUI's)
                    home = tensor.detach()
                    pinned = home.is_pinned()
                    if device.type == "cuda" and not pinned:
                        home, pinned = home.pin_memory(), True
                self._place(kind, name, home.to(device, non_blocking=pinned))
                placed = getattr(self, kind)[name]
                homes[name] = (home, weakref.ref(placed), placed.data_ptr(), pinned)
        return super()._apply(fn, recurse)

    def _place(self, kind: str, name: str, tensor: torch.Tensor) -> None:
        if kind == "_buffers":
            self._buffers[name] = tensor
            return
        parameter = self._parameters[name]
        try:
            parameter.data = tensor  # the Parameter ComfyUI's patches and backups name stays (CPU and CUDA)
        except RuntimeError:  # tensor types that cannot share a Parameter (the meta device's)
            self._parameters[name] = torch.nn.Parameter(tensor, requires_grad=parameter.requires_grad)


_walks = threading.local()  # per thread: the last walk's function (weakly) and its placements


def _placement(fn, tensor: torch.Tensor) -> tuple[torch.device, torch.dtype] | None:
    """Where, and as what, ``fn`` (``Module._apply``'s: ``to``, ``cuda``, ``cpu``, a dtype change) puts
    ``tensor``; None where there is nothing to copy from (the meta device). torch hands one function to every
    module of a walk (``Module.to`` makes one ``convert`` a call), so each kind of tensor (dtype and device)
    is asked once a walk: asking is a zero-size tensor made and moved, for every tensor of every layer
    otherwise."""
    try:
        ref = weakref.ref(fn)
    except TypeError:  # a callable without weak references: asked for every tensor
        ref = None
    walk = getattr(_walks, "last", None)
    if ref is None or walk is None or walk[0]() is not fn:
        walk = (ref, {})
        if ref is not None:
            _walks.last = walk
    key = (tensor.dtype, tensor.device)
    if key not in walk[1]:
        try:
            made = fn(tensor.new_empty(0))
            walk[1][key] = (made.device, made.dtype)
        except NotImplementedError:  # torch says so in its own walk
            walk[1][key] = None
    return walk[1][key]


def _is_home(tensor: torch.Tensor, home: torch.Tensor | None) -> bool:
    """Whether a layer's CPU tensor is its home (put in place by the last move back), page-locked as it was
    made, so that it is neither detached nor asked whether it is page-locked again."""
    return (
        home is not None
        and tensor.data_ptr() == home.data_ptr()
        and tensor.dtype == home.dtype
        and tensor.shape == home.shape
    )


class Int8Ops(comfy.ops.manual_cast):
    """ComfyUI's operations with the pack's layers as its linear and 2-D convolution layers, their 8-bit
    weights with homes in CPU memory (:class:`_HomeCopies`)."""

    class Linear(_HomeCopies, quanto.ScaledWeightLinear):
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

    class Conv2d(_HomeCopies, quanto.ScaledWeightConv2d):
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
    MODEL holding its quantized weights, batching its guidance (:mod:`.batched_guidance`) and refusing images
    too small for ComfyUI's PixArt before sampling (:func:`refuse_small`). Without ``keep_loaded`` ComfyUI
    unloads it after each run (:func:`release_after`).

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
    batched_guidance.apply(patcher)
    patcher.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, CALLBACK_KEY, refuse_small)
    if transformer.compiled and load_device.type == "cuda":
        # ComfyUI's own torch.compile wrapper (its TorchCompileModel node's), block by block as the pack's
        # sampler compiles them: compiled at the first step, on whichever device the blocks then are. Shapes
        # are left to dynamo's automatic dynamic ones: ComfyUI's conditioning is as long as its prompt, and
        # static shapes compiled again for every new prompt length (H200, 2026-12-02: 4.1-5.9 s a prompt, a
        # repeated prompt 1.32 s).
        from comfy_api.torch_helpers import set_torch_compile_wrapper

        set_torch_compile_wrapper(
            patcher,
            backend=sampler_stage.COMPILE_BACKEND,
            dynamic=None,
            keys=[f"diffusion_model.blocks.{index}" for index in range(len(blocks))],
        )
    else:
        # diffusers' blocks over the MODEL's own layers, ComfyUI's forward where they would differ.
        forward = pack_forward.PackForward(model.diffusion_model, transformer.config, config)
        patcher.add_object_patch(pack_forward.OBJECT, forward)
        patcher.add_callback_with_key(CallbacksMP.ON_CLONE, CALLBACK_KEY, forward.follow)
    run = _Run(transformer)
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


def release_after(executor, *args, **kwargs):
    """``OUTER_SAMPLE`` wrapper of a MODEL loaded without ``keep_loaded``: when the sampling run ends (or
    fails, or is cancelled), ComfyUI unloads the MODEL — every loaded clone of it — to its offload device,
    as it unloads its own models to make room, and only it. Its 8-bit weights wait in their page-locked homes
    (:class:`_HomeCopies`); the next run's load copies them back."""
    try:
        return executor(*args, **kwargs)
    finally:
        patcher = executor.class_obj.model_patcher
        comfy_models.unload_alone(
            patcher.load_device, lambda loaded: getattr(loaded.model, "model", None) is patcher.model
        )


class _Run:
    """What a sampling run of the MODEL adds to its layers and takes off after: the ModelPatcher's patches
    for each layer's weight, and the weights held expanded where the device has the room.

    Plain LoRA patches (what ComfyUI's LoRA loaders make of a LoRA file) are read once per set of patches
    (ComfyUI's ``patches_uuid``) into factors in CPU memory, in the compute dtype, all of them in one
    page-locked block (:class:`_Factors`); each run copies that block to the device in one asynchronous copy
    and folds the factors into the expanded weights (:class:`_Fold`), or adds them beside an 8-bit product.
    Any other patch goes through ComfyUI's own ``calculate_weight``."""

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
        factors = self.factors(patcher).on(device)
        for key, layer in self.layers(patcher):
            eight_bit = getattr(layer, "compute", compute_paths.FP16) != compute_paths.FP16
            if key in factors and factors[key] is None:  # patches that are not plain LoRAs
                if eight_bit:
                    _refuse_beside_8_bit(patcher.patches[key], key, layer)
                layer.weight_patch = _Patches(patcher.patches[key], key)
                continue
            branches = factors.get(key) or ()
            if eight_bit:
                layer.low_rank = branches
            else:
                layer.weight_patch = _Fold(branches) if branches else None
        if factors:
            logger.info("PixArt-Σ MODEL: %d layers carry LoRA patches for this run", len(factors))
        dense = quanto.dense_bytes(patcher.model)
        if device.type != "cuda" or not dense:
            return
        # The run's own work for a CFG batch at the native size, beside the expanded weights.
        run = estimates.transformer(self.scheme, self.dtype, 2, self.native**2)[1]
        free = comfy.model_management.get_free_memory(device)
        if dense + run <= free:
            quanto.hold_dense(patcher.model, device)
        else:
            logger.info(
                "PixArt-Σ MODEL: %s free on %s, under the expanded weights' %s and the run's %s: this run "
                "expands each layer's weights at every call",
                measure.format_bytes(free),
                device,
                measure.format_bytes(dense),
                measure.format_bytes(run),
            )

    def end(self, patcher) -> None:
        quanto.drop_dense(patcher.model)
        forward = patcher.object_patches.get(pack_forward.OBJECT)
        if isinstance(forward, pack_forward.PackForward):
            forward.reset()
        for _key, layer in self.layers(patcher):
            layer.weight_patch = None
            if isinstance(layer, quanto.ScaledWeightLinear):
                layer.low_rank = ()


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
    another kind (LoHa, LoKr, DoRA, LoCon's mid, a model strength other than 1)."""
    if not all(_plain_lora(patch) for patch in patches):
        return None
    branches = []
    for strength, adapter, _strength_model, offset, _function in patches:
        up, down, alpha = adapter.weights[:3]
        scale = strength * (1.0 if alpha is None else float(alpha) / down.shape[0])
        rows = None if offset is None else (int(offset[1]), int(offset[2]))
        up, down = (t.to(dtype).flatten(1) for t in (up, down))
        branches.append(compute_paths.LowRank(up, down, scale, rows))
    return tuple(branches)


class _Factors(dict):
    """A set of patches' plain LoRAs (layer key -> its branches, None for a layer with another kind of patch;
    :func:`_plain_loras`), every factor a view of one block of CPU memory (:class:`_Block`), page-locked where
    CUDA is. :meth:`on` puts them on a device with one copy, where a copy a factor was two a LoRA and layer
    (560 for a LoRA on every attention and feed-forward layer of PixArt-Σ, each with its own launch)."""

    def __init__(self, read: dict[str, tuple[compute_paths.LowRank, ...] | None]):
        factors = [tensor for branches in read.values() for b in branches or () for tensor in (b.up, b.down)]
        self.block = _Block(factors, pinned=torch.cuda.is_available())
        super().__init__(_with_factors(read, self.block.views(self.block.memory)))

    def on(self, device: torch.device) -> dict[str, tuple[compute_paths.LowRank, ...] | None]:
        """The same branches with their factors on ``device`` (asynchronously from page-locked memory)."""
        there = self.block.memory.to(device, non_blocking=self.block.pinned)
        return dict(_with_factors(self, self.block.views(there)))


def _with_factors(read: dict, factors: list[torch.Tensor]):
    """``read``'s keys and branches, each branch's ``up`` and ``down`` taken in turn from ``factors``."""
    taken = iter(factors)
    for key, branches in read.items():
        yield (
            key,
            None
            if branches is None
            else tuple(compute_paths.LowRank(next(taken), next(taken), b.scale, b.rows) for b in branches),
        )


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


def _refuse_beside_8_bit(patches: list, key: str, layer) -> None:
    """An 8-bit layer takes plain LoRAs only: another kind's sum needs the expanded weight, which the 8-bit
    path never makes. The first such patch is named."""
    adapter = next(patch[1] for patch in patches if not _plain_lora(patch))
    kind = getattr(adapter, "name", type(adapter).__name__)
    raise ValueError(
        f"{key}: a {kind} patch (or a model strength other than 1) cannot run beside an 8-bit product; "
        f"the int8 Model Loader's compute {layer.compute!r} takes plain LoRAs. Set compute to fp16."
    )


class _Fold:
    """A layer's plain LoRAs as its ``weight_patch``: each added in place to the expanded weight's rows
    (:meth:`~..core.quant.compute.LowRank.fold_into`: one multiply-add a LoRA, no full-size temporaries),
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
