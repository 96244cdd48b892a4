"""Embeddings -> latents, with the PixArt-Σ transformer loaded quantized and freed afterwards."""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable

import torch

from . import estimates, memory, streaming
from .cache import cache
from .devices import as_device, resolve_dtype
from .models import ModelSource, TransformerFile, check_weights, read_transformer_file
from .quant import TRANSFORMER_SCHEMES, Quantization
from .text_encoder import PixArtEmbeds

logger = logging.getLogger(__name__)

SIZE_MULTIPLE = 16  # the VAE's 8× times the transformer's 2× patch
MIN_SIZE, MAX_SIZE = 64, 4096
MAX_BATCH = 64
MAX_STEPS = 1000
MAX_CFG = 100.0
MAX_SEED = 2**64 - 1
LATENT_CHANNELS = 4

# step index (1-based), total steps, current latents (model space)
StepCallback = Callable[[int, int, torch.Tensor], None]

# name -> (diffusers scheduler class, settings over the model's own scheduler config)
_SCHEDULERS: dict[str, tuple[str, dict]] = {
    "dpmsolver++": ("DPMSolverMultistepScheduler", {}),
    "dpmsolver++_karras": ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True}),
    "dpmsolver++_sde": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_ancestral": ("EulerAncestralDiscreteScheduler", {}),
    # DDIM's default clips the predicted sample to [-1, 1], which suits pixels, not these latents.
    "ddim": ("DDIMScheduler", {"clip_sample": False}),
    "unipc": ("UniPCMultistepScheduler", {}),
    "deis": ("DEISMultistepScheduler", {}),
}
SCHEDULERS: tuple[str, ...] = tuple(_SCHEDULERS)
DEFAULT_SCHEDULER = "dpmsolver++"  # what PixArt-Σ ships: the model folder's scheduler config as it is

CUSTOM_RESOLUTION = "custom"
NATIVE_RESOLUTION = "native"  # a square of the model's own size (its transformer's sample_size × 8)


def check_size(name: str, value: int) -> None:
    _check_number(name, value, MIN_SIZE, MAX_SIZE, whole=True, hint=" pixels")
    if value % SIZE_MULTIPLE:
        lower = value - value % SIZE_MULTIPLE
        raise ValueError(
            f"{name} {value} is not a multiple of {SIZE_MULTIPLE}; use {lower} or {lower + SIZE_MULTIPLE}."
        )


def _check_number(name: str, value: object, low: float, high: float, whole: bool, hint: str = "") -> None:
    kinds = (int,) if whole else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(f"{name} must be a {'whole ' if whole else ''}number, got {value!r}.")
    if not low <= value <= high:
        raise ValueError(f"{name} {value} is out of range; use {low}..{high}{hint}.")


def check_settings(
    width: int,
    height: int,
    steps: int,
    cfg: float,
    seed: int,
    batch_size: int,
    scheduler: str = DEFAULT_SCHEDULER,
) -> None:
    check_size("width", width)
    check_size("height", height)
    _check_number("steps", steps, 1, MAX_STEPS, whole=True)
    _check_number("cfg", cfg, 0.0, MAX_CFG, whole=False, hint=" (1 or less turns guidance off)")
    _check_number("seed", seed, 0, MAX_SEED, whole=True)
    _check_number("batch_size", batch_size, 1, MAX_BATCH, whole=True)
    if not isinstance(scheduler, str) or scheduler not in _SCHEDULERS:
        raise ValueError(f"scheduler {scheduler!r} is unknown; choose one of {', '.join(SCHEDULERS)}.")


def check_denoise(denoise: float, has_latent: bool) -> None:
    _check_number(
        "denoise",
        denoise,
        0.0,
        1.0,
        whole=False,
        hint=" (1 starts from noise, 0 returns the latent as it is)",
    )
    if denoise < 1 and not has_latent:
        raise ValueError(
            f"denoise {denoise} needs a latent to start from; connect a LATENT (e.g. VAE Encode with the SDXL "
            f"VAE) or set denoise to 1."
        )


def check_latent_tensor(latents: object, use: str, fix: str) -> None:
    """A LATENT's samples must be a [batch, 4, h, w] tensor (the SDXL VAE's latents)."""
    if not isinstance(latents, torch.Tensor):
        raise TypeError(f"latent must hold a tensor under 'samples', got {type(latents).__name__}.")
    if latents.ndim != 4 or latents.shape[1] != LATENT_CHANNELS:
        raise ValueError(
            f"latent has shape {tuple(latents.shape)}; {use} [batch, {LATENT_CHANNELS}, height/8, width/8]. {fix}"
        )


def check_init_latents(latents: object) -> torch.Tensor:
    """ComfyUI LATENT samples to start from, as float32 on the CPU."""
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


def steps_to_run(steps: int, denoise: float) -> int:
    """How many of the ``steps`` steps a ``denoise`` runs: the last ``steps × denoise``, rounded half up,
    and at least one while denoise is above 0."""
    if denoise >= 1:
        return steps
    if denoise <= 0:
        return 0
    return max(1, math.floor(steps * denoise + 0.5))


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


def check_embeds(embeds: PixArtEmbeds, caption_channels: int, model_name: str) -> None:
    if not isinstance(embeds, PixArtEmbeds):
        raise TypeError(
            f"embeds must come from Quantized T5 Encode (PIXART_EMBEDS), got {type(embeds).__name__}."
        )
    if embeds.width != caption_channels:
        raise ValueError(
            f"embeds are {embeds.width} wide but model {model_name!r} expects {caption_channels} (T5-XXL). "
            f"Encode the prompt with the T5 of the same PixArt-Σ model."
        )


def scaling_factor(source: ModelSource) -> float:
    """The VAE's latent scaling factor, read from its config without loading it."""
    return float(source.config("vae").get("scaling_factor", 0.13025))


class _StartsLater:
    """Mixed into a diffusers scheduler: ``set_timesteps`` drops the first ``skip`` steps of the schedule it
    makes (image-to-image). PixArtSigmaPipeline runs every step its scheduler holds and offers no start
    step; cutting the per-step arrays (timesteps, and sigmas where the scheduler has them) together
    leaves the scheduler a consistent, shorter schedule: its step index, its multistep warm-up and its
    lower-order final step all follow the steps that run."""

    skip = 0

    def set_timesteps(self, *args, **kwargs) -> None:
        super().set_timesteps(*args, **kwargs)
        if self.skip:
            self.timesteps = self.timesteps[self.skip :]
            if getattr(self, "sigmas", None) is not None:
                self.sigmas = self.sigmas[self.skip :]


@functools.cache
def _scheduler_class(name: str) -> type:
    import diffusers

    base = getattr(diffusers, name)
    return type(base.__name__, (_StartsLater, base), {})


def make_scheduler(name: str, config: dict, skip: int = 0):
    """Scheduler ``name`` built from the model's scheduler config (so its betas and timestep spacing carry
    over), running all but the first ``skip`` steps of the schedules it is set to."""
    class_name, settings = _SCHEDULERS[name]
    scheduler = _scheduler_class(class_name).from_config(config, **settings)
    scheduler.skip = skip
    return scheduler


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


def transformer_weights(
    source: ModelSource, transformer_file: str | os.PathLike | None = None
) -> ModelSource | TransformerFile:
    """Where the transformer comes from: ``source``'s transformer/ folder, or ``transformer_file`` (one
    safetensors file) whose config fills what its weights do not say from ``source``'s transformer config
    where ``source`` has one."""
    if transformer_file is None:
        return source
    try:
        folder_config = source.config("transformer")
    except FileNotFoundError:
        folder_config = {}
    return read_transformer_file(transformer_file, folder_config)


def native_size(source: ModelSource, transformer_file: str | os.PathLike | None = None) -> int:
    """The side in pixels the transformer was trained at (512, 1024 or 2048 for PixArt-Σ's variants)."""
    return transformer_weights(source, transformer_file).native_size


def _from_file(weights: TransformerFile, dtype: torch.dtype):
    """A transformer built empty from the file's inferred config, then given the file's weights (renamed
    to diffusers' keys): diffusers has no single-file loader for PixArt."""
    from accelerate import init_empty_weights
    from diffusers import PixArtTransformer2DModel

    with init_empty_weights():
        model = PixArtTransformer2DModel.from_config(weights.config)
    # The weights in ``dtype``; the position embedding buffer stays float32, as from_pretrained keeps it.
    model.load_state_dict({key: value.to(dtype) for key, value in weights.state_dict().items()}, assign=True)
    return model


def _load(
    weights: ModelSource | TransformerFile,
    quant: Quantization,
    dtype: torch.dtype,
    device: torch.device,
    low_vram: bool = False,
    fast: bool = False,
):
    """The transformer, quantized, on ``device``; with ``low_vram`` quantized in CPU memory and its
    blocks streamed to ``device`` one at a time (:mod:`streaming`). ``fast``: the blocks' quantized
    layers hold plain tensors and expand them as they run (``plain_modules``), and the blocks are
    compiled."""
    from diffusers import PixArtTransformer2DModel

    if isinstance(weights, TransformerFile):
        model = _from_file(weights, dtype)
    else:
        folder = weights.folder(["transformer"])
        check_weights(folder / "transformer", weights.name)
        model = PixArtTransformer2DModel.from_pretrained(
            folder, subfolder="transformer", dtype=dtype, use_safetensors=True
        )
    return prepare(model, quant, device, low_vram, fast)


def prepare(model, quant: Quantization, device: torch.device, low_vram: bool = False, fast: bool = False):
    """A loaded transformer (on the CPU) quantized and made ready to run on ``device`` (see ``_load``)."""
    model = quant.after_load(model)
    model.eval()
    blocks = model.transformer_blocks
    if fast:
        quant.plain_modules(blocks)
    if low_vram:
        streaming.stream_blocks(model, blocks, device)
    else:
        model.to(device)
    if fast:
        compile_blocks(blocks)
    return model


COMPILE_BACKEND = "inductor"
FAST_FIX = "Turn the sampler's fast option off (the same image, quanto's own kernels)."


def compile_blocks(blocks: torch.nn.ModuleList) -> None:
    """``torch.compile`` each block's forward (the hooks around it stay eager). The blocks share their
    code, so all 28 run on two compiled graphs (the first block's input comes transposed from the patch
    embedding); a new image size compiles once more."""
    try:
        for block in blocks:
            block.forward = torch.compile(block.forward, backend=COMPILE_BACKEND, dynamic=False)
    except Exception as exc:  # the compiler's own imports (a torch build without a working inductor)
        raise compile_failed(exc) from exc


def compile_failed(exc: BaseException) -> RuntimeError:
    """The error for a torch.compile that cannot run here, at wrapping or at the first call
    (``BackendCompilerFailed``, whose ``inner_exception`` is the compiler's own)."""
    cause = getattr(exc, "inner_exception", None) or exc
    return RuntimeError(
        f"fast: torch.compile failed on this machine ({type(cause).__name__}: {cause}). {FAST_FIX}"
    )


def sample(
    source: ModelSource,
    embeds: PixArtEmbeds,
    width: int = 1024,
    height: int = 1024,
    steps: int = 20,
    cfg: float = 4.5,
    seed: int = 0,
    batch_size: int = 1,
    scheduler: str = DEFAULT_SCHEDULER,
    init_latents: torch.Tensor | None = None,
    denoise: float = 1.0,
    quantization: str = "qint8",
    device: torch.device | str | None = None,
    dtype: str | torch.dtype | None = None,
    keep_loaded: bool = False,
    on_step: StepCallback | None = None,
    report: memory.MemoryReport | None = None,
    low_vram: bool = False,
    transformer_file: str | os.PathLike | None = None,
    on_warning: Callable[[str], None] | None = None,
    fast: bool = False,
) -> torch.Tensor:
    """Denoise from seeded noise, or from ``init_latents`` (image-to-image); return latents
    ``[B, 4, H/8, W/8]`` in raw VAE space (divided by the VAE's scaling factor, as ComfyUI's LATENT holds
    them), float32 on the CPU.

    ``init_latents`` are LATENT samples (raw VAE space). They set the size (width and height are then
    ignored) and the batch: one latent is repeated ``batch_size`` times, a batch of several gives one
    image each. ``denoise`` below 1 noises them to the first of the last ``steps_to_run(steps, denoise)``
    steps of the ``steps``-step schedule and runs those; 1 starts from pure noise of their shape (as
    ComfyUI's Empty Latent Image does: the values are not used); 0 returns them as they are.

    The noise is drawn on the CPU from ``seed``, and the same generator feeds the schedulers that add
    noise at every step (ancestral, SDE), so a seed gives the same image on any device.

    ``low_vram`` keeps the transformer in CPU memory and streams its blocks to the GPU one at a time.

    ``fast`` compiles the transformer's blocks (``torch.compile``; the first image of a process, and of
    each new size, waits for the compile) with their quantized weights expanded to ``dtype`` inside the
    compiled code, one weight at a time, for fp16 matrix products: faster than quanto's kernels, at the
    quantized model's memory.

    ``transformer_file`` (one safetensors file, original PixArt or diffusers layout) replaces ``source``'s
    transformer/; ``source`` still gives the scheduler and the VAE's scaling factor.

    A size far from the model's native one (:func:`size_warning`) is logged and given to ``on_warning``.
    """
    for name, flag in (("low_vram", low_vram), ("fast", fast)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be true or false, got {flag!r}.")
    if init_latents is not None:
        init_latents = check_init_latents(init_latents)
        height, width = (side * 8 for side in init_latents.shape[-2:])
    check_settings(width, height, steps, cfg, seed, batch_size, scheduler)
    check_denoise(denoise, has_latent=init_latents is not None)
    device = as_device(device)
    quant = Quantization(quantization, device, TRANSFORMER_SCHEMES)
    dtype = resolve_dtype(dtype, device, cuda_default=torch.float16, cpu_default=torch.bfloat16)
    weights = transformer_weights(source, transformer_file)
    config = weights.config if isinstance(weights, TransformerFile) else source.config("transformer")
    check_embeds(embeds, config.get("caption_channels", 4096), source.name)
    warning = size_warning(width, height, weights.native_size)
    if warning is not None:
        logger.warning("%s", warning)
        if on_warning is not None:
            on_warning(warning)
    scale = scaling_factor(source)
    images = embeds.batch * batch_size
    if init_latents is not None:
        init_latents = _init_batch(init_latents, embeds.batch, batch_size)
        if denoise == 0:
            return init_latents
        images = init_latents.shape[0]

    generator = torch.Generator("cpu").manual_seed(seed)
    # Drawn in fp32 on the CPU: a low-precision draw gives other numbers on some torch versions.
    noise = torch.randn(
        (images, LATENT_CHANNELS, height // 8, width // 8), generator=generator, dtype=torch.float32
    )
    schedule = make_scheduler(
        scheduler, source.config("scheduler"), skip=steps - steps_to_run(steps, denoise)
    )
    latents = noise
    if init_latents is not None and denoise < 1:
        schedule.set_timesteps(steps)
        noised = schedule.add_noise(init_latents * scale, noise, schedule.timesteps[:1])
        # The pipeline multiplies the latents it is given by init_noise_sigma, as it does pure noise.
        latents = noised / schedule.init_noise_sigma
    with memory.stage("sample", device, report):
        latents = _sample(
            weights,
            embeds,
            latents,
            steps,
            cfg,
            schedule,
            generator,
            quant,
            dtype,
            device,
            keep_loaded,
            on_step,
            low_vram,
            fast,
        )
    return latents / scale


def _sample(
    weights,
    embeds,
    latents,
    steps,
    cfg,
    schedule,
    generator,
    quant,
    dtype,
    device,
    keep_loaded,
    on_step,
    low_vram,
    fast,
) -> torch.Tensor:
    # Its own frame: once it has returned or raised, nothing here keeps the transformer alive.
    from diffusers import PixArtSigmaPipeline

    key = ("transformer", weights.key, quant.scheme, dtype, str(device), low_vram, fast)
    total = steps - schedule.skip
    load = lambda: _load(weights, quant, dtype, device, low_vram, fast)  # noqa: E731
    room = estimates.transformer(
        quant.scheme, dtype, latents, low_vram
    )  # (weights, work) bytes, for the host
    with cache.use(key, load, keep_loaded, device, *room) as transformer:
        pipe = PixArtSigmaPipeline(
            tokenizer=None, text_encoder=None, vae=None, transformer=transformer, scheduler=schedule
        )
        pipe.set_progress_bar_config(disable=True)

        def callback(step: int, _t, latents: torch.Tensor) -> None:
            if on_step is not None:
                on_step(step + 1, total, latents)

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
                num_inference_steps=steps,
                guidance_scale=cfg,
                num_images_per_prompt=latents.shape[0] // embeds.batch,
                generator=generator,
                output_type="latent",
                use_resolution_binning=False,
                callback=callback,
                return_dict=False,
            )[0]
        except torch._dynamo.exc.BackendCompilerFailed as exc:  # fast only: nothing else compiles
            raise compile_failed(exc) from exc
    return latents.float().cpu()
