"""Embeddings -> latents, with the PixArt-Σ transformer loaded quantized and freed afterwards."""

from __future__ import annotations

import dataclasses
import logging

import torch

from . import lora, measure, step_graph, transformer_run
from .contract import (
    LATENT_CHANNELS,
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
from .quant import compute as compute_paths
from .sampler_settings import INPUTS, SamplerSettings
from .schedulers import make_scheduler, steps_to_run

logger = logging.getLogger(__name__)


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
    drawn = generator.get_state()
    with measure.stage("sample", settings.device, report, settings.out_of_memory_advice()):
        try:
            latents = _sample(settings, embeds, latents, schedule, generator, on_progress, on_warning)
        except transformer_run.CompileFailed as exc:
            if not _compiled_for_auto(settings):
                raise
            # auto's 8-bit compute compiles its blocks; where the compiler fails, fp16 uncompiled instead,
            # for this prompt and (compute.compiler) every later one of the process.
            compute_paths.compiler_failed(exc.cause)
            logger.warning(
                "compute auto: torch.compile failed on this machine (%s); running compute fp16 instead",
                exc.cause,
            )
            settings = dataclasses.replace(settings, compute=compute_paths.FP16)
            generator.set_state(drawn)
            latents = _sample(settings, embeds, latents, schedule, generator, on_progress, on_warning)
    return latents / scale


def _compiled_for_auto(settings: SamplerSettings) -> bool:
    """Whether the blocks compiled only because ``auto`` chose an 8-bit compute (no ``fast`` asked for)."""
    chosen = settings.compute == compute_paths.AUTO and settings.transformer.compute != compute_paths.FP16
    return chosen and not settings.fast


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
            lambda: transformer_run._load(settings, streamed),
            settings.keep_loaded,
            device,
            *settings.device_bytes(work),
        ) as transformer,
        lora.applied(transformer, settings.loras, on_warning),
        transformer_run._dense(settings, transformer, work),
        transformer_run._step_cache(transformer, settings.step_cache, total),
        step_graph.graphed(
            transformer, step_graph.wanted(device, settings.compiled, streamed, settings.step_cache)
        ),
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
            transformer_run.settle_attention(
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
            raise transformer_run.compile_failed(exc) from exc
    return latents.float().cpu()
