"""Embeddings -> latents, with the PixArt-Σ transformer loaded quantized and freed afterwards."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import attention, estimates, inputs, lora, measure, streaming
from .contract import (
    LATENT_CHANNELS,
    MAX_SIZE,
    MIN_SIZE,
    SIZE_MULTIPLE,
    PixArtEmbeds,
    ProgressCallback,
    WarningCallback,
    check_embeds,
    check_latent_tensor,
    check_size,
    warn,
)
from .estimates import Workload
from .models import ModelSource
from .pool import cache
from .quant import Scheme, quanto
from .quant import compute as compute_paths
from .schedulers import DEFAULT_SCHEDULER, SCHEDULERS, make_scheduler, steps_to_run
from .single_files import TransformerFile
from .transformer import INPUTS as TRANSFORMER_INPUTS
from .transformer import TransformerSettings, quantized_transformer

logger = logging.getLogger(__name__)

MAX_BATCH = 64
MAX_STEPS = 1000
MAX_CFG = 100.0
MAX_SEED = 2**64 - 1
CUSTOM_RESOLUTION = "custom"
NATIVE_RESOLUTION = "native"  # a square of the model's own size (its transformer's sample_size × 8)


def _size(name: str) -> inputs.Input:
    return inputs.Input(
        name,
        inputs.INT,
        1024,
        f"Image {name} in pixels, a multiple of {SIZE_MULTIPLE}. Used when resolution is custom and no latent "
        "is connected.",
        min=MIN_SIZE,
        max=MAX_SIZE,
        step=SIZE_MULTIPLE,
        unset=None,  # the model's own size
        checked=False,  # check_size(), once the size is worked out
        help=f"pixels, a multiple of {SIZE_MULTIPLE} in {MIN_SIZE}..{MAX_SIZE} (default: the model's size)",
    )


# The sampling stage's inputs in its node's order (see inputs.py).
INPUTS = inputs.Inputs(
    TRANSFORMER_INPUTS["model"],
    inputs.slot("embeds"),
    _size("width"),
    _size("height"),
    inputs.Input(
        "steps",
        inputs.INT,
        20,
        "Denoising steps of the schedule; from a latent with denoise below 1, only the last steps × denoise "
        "of them run.",
        min=1,
        max=MAX_STEPS,
        help="denoising steps",
    ),
    inputs.Input(
        "cfg",
        inputs.FLOAT,
        4.5,
        "Classifier-free guidance scale; 1 or less turns guidance off.",
        min=0.0,
        max=MAX_CFG,
        step=0.1,
        round=0.01,
        hint=" (1 or less turns guidance off)",
        help="classifier-free guidance scale",
    ),
    inputs.Input(
        "seed",
        inputs.INT,
        0,
        "Noise seed; noise is drawn on the CPU, so a seed gives the same image on any device.",
        min=0,
        max=MAX_SEED,
        control_after_generate=True,
        help="noise seed (same seed, same image on any device)",
    ),
    inputs.Input(
        "batch_size", inputs.INT, 1, "Images per prompt.", min=1, max=MAX_BATCH, help="images per prompt"
    ),
    # Named `weights` before; at the same place, so saved workflows keep their value. `--quant` is the
    # command line's name of earlier versions.
    TRANSFORMER_INPUTS["quantization"],
    inputs.KEEP_LOADED,
    # Optional and after the others, so workflows saved before they existed still load.
    inputs.slot("latent", optional=True),
    inputs.Input(
        "resolution",
        inputs.CHOICE,
        CUSTOM_RESOLUTION,
        "custom: width and height. native: a square of the model's own size (512, 1024 or 2048 px, from its "
        "transformer). Otherwise one of PixArt's aspect-ratio sizes for its 512, 1024 and 2048 px models, "
        "listed as width×height (width:height).",
        choices=lambda: [CUSTOM_RESOLUTION, NATIVE_RESOLUTION, *resolution_presets()],
        optional=True,
        checked=False,  # preset_size()
        metavar="{custom,native,PRESET}",
        help="custom: --width and --height (each the model's size when left out); native: a square of the "
        "model's size; or a preset such as '1024: 1024×1024 (1:1)'",
    ),
    inputs.Input(
        "scheduler",
        inputs.CHOICE,
        DEFAULT_SCHEDULER,
        "dpmsolver++: the model's own scheduler (DPM-Solver++ 2M). The others are built from its config; "
        "euler_ancestral and dpmsolver++_sde add seeded noise at every step.",
        choices=SCHEDULERS,
        optional=True,
        help="sampler",
    ),
    inputs.Input(
        "denoise",
        inputs.FLOAT,
        1.0,
        "With a latent: how much of it is redrawn. 1 starts from noise (the latent gives only size and "
        "batch), 0 returns it unchanged. Below 1 needs a latent.",
        min=0.0,
        max=1.0,
        step=0.01,
        optional=True,
        hint=" (1 starts from noise, 0 returns the latent as it is)",
        flags=(),  # the command line starts from no latent
    ),
    inputs.low_vram("the transformer's 28 blocks"),
    TRANSFORMER_INPUTS["transformer_file"],
    inputs.Input(
        "fast",
        inputs.BOOL,
        False,
        "Compile the transformer's blocks (torch.compile) and run them on weights expanded from qint8/qfloat8 "
        "to fp16 one block at a time: faster than fp16 at about the quantized model's memory. The first image "
        "of a session (and of each new size) waits for the compile, about 20 s on a GPU; keep_loaded keeps "
        "the compiled model. Needs a working torch.compile (Triton on NVIDIA GPUs).",
        optional=True,
        help="the fast sampler path: compiled blocks on weights expanded one block at a time (compiles first)",
    ),
    inputs.slot("loras", optional=True),
    inputs.Input(
        "step_cache",
        inputs.FLOAT,
        0.0,
        "Lossy, off at 0: reuse the transformer's work across steps (diffusers' First Block Cache). At each "
        "step the first block runs; when its output changed by less than this fraction since the last full "
        "step, the other blocks are skipped and their last change reused. Higher is faster and further from "
        "the uncached image; about 0.05–0.1 is a common range. The same seed still gives the same image.",
        min=0.0,
        max=1.0,
        step=0.01,
        round=0.001,
        optional=True,
        hint=" (0 turns it off)",
        help="lossy: skip the transformer's blocks 2.. on steps where the first block's output changed by less "
        "than this fraction (diffusers' First Block Cache; 0 = off)",
    ),
    TRANSFORMER_INPUTS["compute"],
)


@dataclass(frozen=True)
class SamplerSettings:
    """Every choice of the sampling stage, checked when it is made (before anything loads): what a node or
    the command line builds once and hands to :func:`sample`. The transformer's own choices (``model``,
    ``transformer_file``, ``quantization``, ``compute``, ``precision``, ``device``, ``quant_cache``) are
    given here as the others are and make its :class:`~.transformer.TransformerSettings` (``transformer``),
    which works out what follows from them (``scheme``, ``dtype``, where the weights come from and their
    config); the size a ``resolution`` stands for is worked out here, and nowhere else.

    ``resolution``: ``custom`` takes ``width`` and ``height`` (a side left None is the model's native size),
    ``native`` a square of the model's own size, otherwise one of :func:`resolution_presets`. A LATENT given
    to :func:`sample` sets the size instead. ``denoise`` below 1 needs that latent (image-to-image).
    ``transformer_file`` (one safetensors file, original PixArt or diffusers layout) replaces ``model``'s
    transformer/; ``model`` still gives the scheduler and the VAE's scaling factor.
    The quantized layers compute what quanto's generic matrix product computes (the weight expanded, then
    an fp16 matrix product) as plain torch layers; on a GPU, and without ``low_vram``, they hold their weights
    expanded for the run (``dense``: about 1.2 GiB more at 1024², still below T5's peak, when the device has
    the room), so a run costs what the unquantized model's does while the int8 weights are what is kept,
    pooled and copied. ``low_vram`` holds the stage to :data:`estimates.LOW_VRAM_BUDGET`: the quantized
    transformer stays whole on the GPU for its run when it fits (the int8 model at 1024²), else it stays in
    CPU memory and its blocks stream to the GPU one at a time (:meth:`streamed`).
    ``fast`` runs the blocks compiled (``torch.compile``); the first image of a process, and of each new
    size, waits for the compile. ``keep_loaded`` keeps the transformer for the next prompt instead of
    unloading it. With
    ``quant_cache`` (a folder) the quantized transformer is saved there on first use and read back later
    (:mod:`quant_cache`), as T5 is. ``loras`` are added to the transformer's weights for the run
    (:mod:`lora`): the kept and pooled transformer stays the one without them. ``step_cache`` above 0 skips
    the blocks after the first on steps where the first block's output barely changed (:func:`_step_cache`;
    lossy)."""

    model: ModelSource
    width: int | None = INPUTS.field_default("width")
    height: int | None = INPUTS.field_default("height")
    resolution: str = INPUTS.field_default("resolution")
    steps: int = INPUTS.field_default("steps")
    cfg: float = INPUTS.field_default("cfg")
    seed: int = INPUTS.field_default("seed")
    batch_size: int = INPUTS.field_default("batch_size")
    scheduler: str = INPUTS.field_default("scheduler")
    denoise: float = INPUTS.field_default("denoise")
    quantization: str = INPUTS.field_default("quantization")
    device: torch.device | str | None = None
    precision: str | torch.dtype | None = None
    keep_loaded: bool = INPUTS.field_default("keep_loaded")
    low_vram: bool = INPUTS.field_default("low_vram")
    fast: bool = INPUTS.field_default("fast")
    step_cache: float = INPUTS.field_default("step_cache")
    compute: str = INPUTS.field_default("compute")
    transformer_file: str | os.PathLike | None = None
    quant_cache: str | os.PathLike | None = None
    loras: tuple[lora.LoraSpec, ...] = ()
    transformer: TransformerSettings = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # A size given for resolution custom is checked with the other inputs (one error names them all);
        # the sizes worked out from the model are checked below.
        given = [(n, v) for n, v in (("width", self.width), ("height", self.height)) if v is not None]
        sizes = given if self.resolution == CUSTOM_RESOLUTION else []
        INPUTS.check(self, *(functools.partial(check_size, name, value) for name, value in sizes))
        if self.quant_cache is not None:
            object.__setattr__(self, "quant_cache", Path(self.quant_cache))
        object.__setattr__(self, "loras", tuple(self.loras))
        for spec in self.loras:
            if not isinstance(spec, lora.LoraSpec):
                raise TypeError(f"loras holds {spec!r}; each must be a LoraSpec (a file and a strength).")
        transformer = TransformerSettings(
            self.model,
            transformer_file=self.transformer_file,
            quantization=self.quantization,
            compute=self.compute,
            precision=self.precision,
            device=self.device,
            quant_cache=self.quant_cache,
            also_reads=["scheduler"],
            fast=self.fast and not self.low_vram,  # auto's fp8 is measured without low_vram
        )
        native = transformer.native_size
        derived = {"transformer": transformer, "device": transformer.device, "compute": transformer.compute}
        if self.resolution == NATIVE_RESOLUTION:
            derived["width"] = derived["height"] = native
        elif self.resolution == CUSTOM_RESOLUTION:
            derived["width"] = native if self.width is None else self.width
            derived["height"] = native if self.height is None else self.height
        else:
            derived["width"], derived["height"] = preset_size(self.resolution, self.width, self.height)
        check_size("width", derived["width"])
        check_size("height", derived["height"])
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    # What every stage's settings say (the stage contract), and what the sampling reads: the transformer's.
    @property
    def scheme(self) -> Scheme:
        return self.transformer.scheme

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def weights(self) -> ModelSource | TransformerFile:
        return self.transformer.weights

    @property
    def native_size(self) -> int:
        return self.transformer.native_size

    @property
    def caption_channels(self) -> int:
        return self.transformer.caption_channels

    @property
    def compiled(self) -> bool:
        """Whether the blocks run compiled: with ``fast``, or for the compute's sake
        (:attr:`.transformer.TransformerSettings.compiled`)."""
        return self.fast or self.transformer.compiled

    @property
    def dense(self) -> bool:
        """Whether a run holds the quantized weights expanded (:attr:`.transformer.TransformerSettings.dense`,
        without low_vram)."""
        return not self.low_vram and self.transformer.dense

    def streamed(self, work: Workload) -> bool:
        """Whether a run of ``work`` streams the blocks from CPU memory: with low_vram, when the whole
        transformer and its run would not fit in the low-VRAM budget."""
        if not self.low_vram:
            return False
        run = estimates.transformer(self.scheme, self.dtype, work.images, work.pixels)
        return sum(run) > estimates.LOW_VRAM_BUDGET

    def cache_key(self, work: Workload) -> tuple:
        """What a kept transformer is found by: the same weights, quantized and placed the same way."""
        return (
            "transformer",
            self.weights.key,
            self.scheme.name,
            self.dtype,
            str(self.device),
            self.low_vram,
            self.streamed(work),
            self.compiled,
            self.compute,
        )

    def device_bytes(self, work: Workload) -> tuple[int, int]:
        """(weights, work) bytes the stage holds on its device for a run of ``work``."""
        return estimates.transformer(
            self.scheme, self.dtype, work.images, work.pixels, self.streamed(work), self.dense
        )

    def out_of_memory_advice(self) -> str:
        steps = (
            [] if self.low_vram else ["turn on low_vram (the transformer's blocks streamed from CPU memory)"]
        )
        steps.append("lower width, height or batch_size")
        if self.scheme.if_out_of_memory:
            steps.append(self.scheme.if_out_of_memory)
        return ", ".join([*steps, measure.FREE_OTHERS])


def check_denoise(denoise: float, has_latent: bool = True) -> None:
    """``denoise`` in its declared range (0..1); below 1 only with a latent to start from."""
    INPUTS["denoise"].check(denoise)
    if denoise < 1 and not has_latent:
        raise ValueError(
            f"denoise {denoise} needs a latent to start from; connect a LATENT (e.g. VAE Encode with the SDXL "
            f"VAE) or set denoise to 1."
        )


def check_init_latents(latents: object) -> torch.Tensor:
    """LATENT samples to start from, as float32 on the CPU."""
    check_latent_tensor(
        latents,
        "PixArt-Σ samples from",
        "Make it with Empty Latent Image or VAE Encode with the SDXL VAE (sdxl_vae.safetensors).",
    )
    check_size("latent width", latents.shape[3] * 8)
    check_size("latent height", latents.shape[2] * 8)
    return latents.detach().to("cpu", torch.float32)


def _init_batch(latents: torch.Tensor, prompts: int, batch_size: int) -> torch.Tensor:
    """One latent is repeated for every image; a batch of them gives one image each."""
    count = latents.shape[0]
    if count == 1:
        return latents.repeat(prompts * batch_size, 1, 1, 1)
    if count % prompts or batch_size not in (1, count // prompts):
        raise ValueError(
            f"latent holds a batch of {count} and batch_size is {batch_size}; a batch of latents gives one "
            f"image each: set batch_size to 1, or use a latent batch of 1 to repeat it batch_size times."
        )
    return latents


@functools.cache
def resolution_presets() -> dict[str, tuple[int, int]]:
    """PixArt's aspect-ratio bins for its 512, 1024 and 2048 px models: label -> (width, height)."""
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import (
        ASPECT_RATIO_512_BIN,
        ASPECT_RATIO_1024_BIN,
    )
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma import ASPECT_RATIO_2048_BIN

    presets = {}
    for base, bins in (
        (512, ASPECT_RATIO_512_BIN),
        (1024, ASPECT_RATIO_1024_BIN),
        (2048, ASPECT_RATIO_2048_BIN),
    ):
        # Each bin is keyed by height / width and holds [height, width].
        for height, width in (map(int, size) for size in bins.values()):
            presets[f"{base}: {width}×{height} ({_aspect(width, height)})"] = (width, height)
    return presets


def _aspect(width: int, height: int) -> str:
    if width == height:
        return "1:1"
    return f"{width / height:.2f}:1" if width > height else f"1:{height / width:.2f}"


def preset_size(resolution: str, width: int, height: int) -> tuple[int, int]:
    """(width, height) for a ``resolution`` choice: the preset's, or width and height when it is custom."""
    if resolution == CUSTOM_RESOLUTION:
        return width, height
    presets = resolution_presets()
    if resolution not in presets:
        raise ValueError(
            f"resolution {resolution!r} is not a preset; use {CUSTOM_RESOLUTION!r} (width and height) or a "
            f"preset such as {next(iter(presets))!r}."
        )
    return presets[resolution]


def scaling_factor(source: ModelSource) -> float:
    """The VAE's latent scaling factor, read from its config without loading it."""
    return float(source.config("vae").get("scaling_factor", 0.13025))


def size_warning(width: int, height: int, native: int) -> str | None:
    """A warning when the image's area is 4× the model's native square or more, or a quarter or less: the
    transformer recomputes its position embedding for any size, so it runs, but far from its training size
    it repeats subjects (larger) or loses detail (smaller)."""
    ratio = width * height / native**2
    if 1 / 4 < ratio < 4:
        return None
    return (
        f"width × height {width}×{height} is {'at least 4×' if ratio >= 4 else 'at most ¼ of'} the area of the "
        f"model's native {native}×{native}; images far from that size come out with repeated subjects or lost "
        f"detail. Use a size near {native} px (resolution 'native' or a preset of the {native} model), or the "
        f"model made for this size."
    )


def _load(settings: SamplerSettings, streamed: bool):
    """The transformer, quantized (:func:`.transformer.quantized_transformer`), on the settings' device; ``streamed``:
    kept in CPU memory and its blocks streamed to the device one at a time (:mod:`streaming`). ``fast``:
    the blocks are compiled."""
    return prepare(
        quantized_transformer(settings.transformer),
        settings.scheme,
        settings.device,
        streamed,
        settings.compiled,
        quantized=True,
        compute=settings.compute,
    )


def prepare(
    model,
    scheme: Scheme,
    device: torch.device,
    low_vram: bool = False,
    fast: bool = False,
    quantized: bool = False,
    compute: str = compute_paths.FP16,
):
    """A loaded transformer (on the CPU) quantized — unless ``quantized`` says it is already — and made
    ready to run on ``device`` (see ``_load``); ``low_vram``: its blocks streamed; ``fast``: its blocks
    compiled; ``compute``: how its blocks' quantized layers compute (:mod:`.quant.compute`)."""
    if not quantized:
        model = scheme.after_load(model)
    # No gradients: the same parameter types on every run, whether the weights were moved whole or copied
    # back from host memory (the compiled fast path would compile again for another requires_grad).
    model.eval().requires_grad_(False)
    blocks = model.transformer_blocks
    attention.install(model)
    scheme.plain_modules(model)
    quanto.set_compute(blocks, compute)
    if compute != compute_paths.FP16:
        from .quant import block  # imports Triton where it is installed

        if block.wanted(device):
            block.use_fused(blocks, compute)
    if low_vram:
        streaming.stream_blocks(model, blocks, device)
    else:
        streaming.move_model(model, device)
    if fast:
        compile_blocks(blocks)
    return model


@contextlib.contextmanager
def _dense(settings: SamplerSettings, transformer, work: Workload) -> Iterator[None]:
    """The run with the quantized weights held expanded (:attr:`SamplerSettings.dense`) when the device has
    room for them beside the run itself; otherwise each layer expands its weight as it runs (the same
    numbers, more kernel launches)."""
    if not settings.dense:
        yield
        return
    # The run's own work: the stage's estimate (device_bytes) counts the expanded copy in already.
    _weights, run = estimates.transformer(settings.scheme, settings.dtype, work.images, work.pixels)
    needed = settings.scheme.dense_bytes(transformer) + run
    room = measure.device_room(settings.device)
    if needed > room:
        logger.info(
            "sampler: %s free on %s, %s needed to hold the weights expanded; expanding them per layer",
            measure.format_bytes(room),
            settings.device,
            measure.format_bytes(needed),
        )
        yield
        return
    with settings.scheme.dense_weights(transformer):
        yield


@contextlib.contextmanager
def _step_cache(transformer, threshold: float, steps: int) -> Iterator[None]:
    """The run with diffusers' First Block Cache on the transformer's blocks (``threshold`` > 0): each step
    runs the first block, and where its output's change since the last full step, relative to that step's,
    is below ``threshold`` the other blocks return at once and their last change is added instead. The
    hooks come off after the run: the kept and pooled transformer stays the one without them. Logs on how
    many steps the blocks after the first ran."""
    if threshold <= 0:
        yield
        return
    from diffusers.hooks import FirstBlockCacheConfig, HookRegistry, apply_first_block_cache
    from diffusers.hooks.first_block_cache import _FBC_BLOCK_HOOK, _FBC_LEADER_BLOCK_HOOK
    from diffusers.models.cache_utils import CacheMixin

    # The last block's attention runs only on steps where the blocks after the first run.
    full = [0]
    counter = transformer.transformer_blocks[-1].attn1.register_forward_hook(
        lambda *_: full.__setitem__(0, full[0] + 1)
    )
    apply_first_block_cache(transformer, FirstBlockCacheConfig(threshold=threshold))
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    # Newer diffusers cache each registry's children: refreshed so the context reaches the new block hooks.
    refresh = getattr(registry, "invalidate_child_registries_cache", lambda: None)
    refresh()
    try:
        # diffusers' cache hooks keep their state per named context, which its own pipelines set with
        # CacheMixin.cache_context (a mixin PixArt's transformer class lacks; the method uses only the module).
        with CacheMixin.cache_context(transformer, "cfg"):
            yield
    finally:
        registry.remove_hook(_FBC_LEADER_BLOCK_HOOK, recurse=True)
        registry.remove_hook(_FBC_BLOCK_HOOK, recurse=True)
        refresh()
        counter.remove()
    logger.info(
        "sampler: step_cache %g ran every block on %d of %d steps, only the first on the others",
        threshold,
        full[0],
        steps,
    )


def settle_attention(config, device, dtype, batch: int, height: int, width: int, keys: int, masked: bool):
    """The attention choices for a compiled run of a transformer of ``config`` (:func:`.attention.settle`),
    made before its blocks are traced, at its shapes: ``batch`` items of ``height`` × ``width`` latents
    (their patches the queries) and ``keys`` caption tokens, ``masked`` or not."""
    attention.settle(
        device,
        dtype,
        batch=batch,
        heads=config.num_attention_heads,
        head_dim=config.attention_head_dim,
        queries=(height // config.patch_size) * (width // config.patch_size),
        keys=keys,
        masked=masked,
    )


COMPILE_BACKEND = "inductor"
FAST_FIX = (
    "Turn the sampler's fast option off and set compute to fp16 (the blocks then run uncompiled; fast alone "
    "gives the same image uncompiled)."
)


def compile_blocks(blocks: torch.nn.ModuleList, captions_vary: bool = False) -> None:
    """``torch.compile`` each block's forward (the hooks around it stay eager). The blocks share their
    code and the first takes its input as the others do (:func:`_as_blocks_take`), so all 28 run on one
    compiled graph; a new image size compiles once more. ``captions_vary``: the caption's length is dynamic
    from the first compile (ComfyUI's conditioning is as long as its prompt), so every length runs that one
    graph, and a prompt gives the same image whatever ran before it; otherwise (the sampler's caption, padded
    to a fixed length) every shape is static."""
    try:
        for block in blocks:
            block.forward = torch.compile(
                block.forward, backend=COMPILE_BACKEND, dynamic=None if captions_vary else False
            )
    except Exception as exc:  # the compiler's own imports (a torch build without a working inductor)
        raise compile_failed(exc) from exc
    blocks[0].register_forward_pre_hook(functools.partial(_as_blocks_take, captions_vary), with_kwargs=True)


def _as_blocks_take(captions_vary: bool, _block, args: tuple, kwargs: dict):
    """The first block's pre-hook: its hidden states row-major, as every other block takes them (the patch
    embedding's come transposed: a graph of their own, where inductor laid the 8-bit activations of the
    first block out column-major, which ``torch._int_mm`` refuses on CUDA unless the rows are a multiple of
    4), and with ``captions_vary`` the caption's length marked dynamic."""
    if captions_vary and kwargs.get("encoder_hidden_states") is not None:
        torch._dynamo.maybe_mark_dynamic(kwargs["encoder_hidden_states"], 1)
    hidden = args[0]
    if hidden.is_contiguous():
        return None
    return (hidden.contiguous(), *args[1:]), kwargs


def compile_failed(exc: BaseException) -> RuntimeError:
    """The error for a torch.compile that cannot run here, at wrapping or at the first call
    (``BackendCompilerFailed``, whose ``inner_exception`` is the compiler's own)."""
    cause = getattr(exc, "inner_exception", None) or exc
    return RuntimeError(
        f"fast: torch.compile failed on this machine ({type(cause).__name__}: {cause}). {FAST_FIX}"
    )


def sample(
    settings: SamplerSettings,
    embeds: PixArtEmbeds,
    init_latents: torch.Tensor | None = None,
    report: measure.MemoryReport | None = None,
    on_warning: WarningCallback | None = None,
    on_progress: ProgressCallback | None = None,
) -> torch.Tensor:
    """Denoise from seeded noise, or from ``init_latents`` (image-to-image); return latents
    ``[B, 4, H/8, W/8]`` in raw VAE space (divided by the VAE's scaling factor, as ComfyUI's LATENT holds
    them), float32 on the CPU.

    ``init_latents`` are LATENT samples (raw VAE space). They set the size (the settings' width and height
    are then ignored) and the batch: one latent is repeated ``batch_size`` times, a batch of several gives
    one image each. ``denoise`` below 1 noises them to the first of the last ``steps_to_run(steps, denoise)``
    steps of the ``steps``-step schedule and runs those; 1 starts from pure noise of their shape (as an empty
    latent does: the values are not used); 0 returns them as they are.

    The noise is drawn on the CPU from ``seed``, and the same generator feeds the schedulers that add
    noise at every step (ancestral, SDE), so a seed gives the same image on any device.

    A size far from the model's native one (:func:`size_warning`) is logged and given to ``on_warning``.
    ``on_progress(step, total, latents)`` is called after each step with the latents in model space; an
    exception it raises (a cancel) ends the stage like any other.
    """
    width, height = settings.width, settings.height
    if init_latents is not None:
        init_latents = check_init_latents(init_latents)
        height, width = (side * 8 for side in init_latents.shape[-2:])
    check_denoise(settings.denoise, has_latent=init_latents is not None)
    check_embeds(embeds, settings.caption_channels, settings.model.name)
    warn(logger, size_warning(width, height, settings.native_size), on_warning)
    scale = scaling_factor(settings.model)
    images = embeds.batch * settings.batch_size
    if init_latents is not None:
        init_latents = _init_batch(init_latents, embeds.batch, settings.batch_size)
        if settings.denoise == 0:
            return init_latents
        images = init_latents.shape[0]

    generator = torch.Generator("cpu").manual_seed(settings.seed)
    # Drawn in fp32 on the CPU: a low-precision draw gives other numbers on some torch versions.
    noise = torch.randn(
        (images, LATENT_CHANNELS, height // 8, width // 8), generator=generator, dtype=torch.float32
    )
    steps = settings.steps
    schedule = make_scheduler(
        settings.scheduler,
        settings.model.config("scheduler"),
        skip=steps - steps_to_run(steps, settings.denoise),
    )
    latents = noise
    if init_latents is not None and settings.denoise < 1:
        schedule.set_timesteps(steps)
        noised = schedule.add_noise(init_latents * scale, noise, schedule.timesteps[:1])
        # The pipeline multiplies the latents it is given by init_noise_sigma, as it does pure noise.
        latents = noised / schedule.init_noise_sigma
    with measure.stage("sample", settings.device, report, settings.out_of_memory_advice()):
        latents = _sample(settings, embeds, latents, schedule, generator, on_progress, on_warning)
    return latents / scale


def _sample(
    settings: SamplerSettings, embeds, latents, schedule, generator, on_progress, on_warning
) -> torch.Tensor:
    # Its own frame: once it has returned or raised, nothing here keeps the transformer alive.
    from diffusers import PixArtSigmaPipeline

    device, dtype = settings.device, settings.dtype
    total = settings.steps - schedule.skip
    work = Workload.of(latents)
    streamed = settings.streamed(work)
    with (
        cache.use(
            settings.cache_key(work),
            lambda: _load(settings, streamed),
            settings.keep_loaded,
            device,
            *settings.device_bytes(work),
        ) as transformer,
        lora.applied(transformer, settings.loras, on_warning),
        _dense(settings, transformer, work),
        _step_cache(transformer, settings.step_cache, total),
    ):
        pipe = PixArtSigmaPipeline(
            tokenizer=None, text_encoder=None, vae=None, transformer=transformer, scheduler=schedule
        )
        pipe.set_progress_bar_config(disable=True)

        def callback(step: int, _t, latents: torch.Tensor) -> None:
            if on_progress is not None:
                on_progress(step + 1, total, latents)

        if settings.compiled:
            # Both halves of the guidance batch; the padded caption's mask.
            guided = 2 if settings.cfg > 1 else 1
            settle_attention(
                transformer.config, device, dtype, latents.shape[0] * guided, *latents.shape[-2:],
                keys=embeds.prompt_embeds.shape[1], masked=True,
            )  # fmt: skip
        try:
            latents = pipe(
                negative_prompt=None,
                prompt_embeds=embeds.prompt_embeds.to(device, dtype),
                prompt_attention_mask=embeds.prompt_mask.to(device),
                negative_prompt_embeds=embeds.negative_embeds.to(device, dtype),
                negative_prompt_attention_mask=embeds.negative_mask.to(device),
                latents=latents.to(device, dtype),
                width=latents.shape[-1] * 8,
                height=latents.shape[-2] * 8,
                num_inference_steps=settings.steps,
                guidance_scale=settings.cfg,
                num_images_per_prompt=latents.shape[0] // embeds.batch,
                generator=generator,
                output_type="latent",
                use_resolution_binning=False,
                callback=callback,
                return_dict=False,
            )[0]
        except (
            torch._dynamo.exc.BackendCompilerFailed
        ) as exc:  # fast and 8-bit compute: nothing else compiles
            raise compile_failed(exc) from exc
    return latents.float().cpu()
