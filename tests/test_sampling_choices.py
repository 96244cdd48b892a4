"""Sampling choices: schedulers, resolution presets and image-to-image from a LATENT with a denoise
strength. Schedulers are checked against diffusers' ``PixArtSigmaPipeline`` running the same scheduler,
and image-to-image against diffusers' image-to-image recipe (fp32, quantization off)."""

from __future__ import annotations

import diffusers
import pytest
import torch
from diffusers import PixArtSigmaPipeline
from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import ASPECT_RATIO_512_BIN, ASPECT_RATIO_1024_BIN
from diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma import ASPECT_RATIO_2048_BIN

from pixart_lowvram.core import contract, resolutions, sampler, sampler_settings, schedulers

SIZE = 64
FP32 = {"quantization": "none", "device": "cpu", "precision": torch.float32}
# What each scheduler name means in diffusers' terms, written out here rather than read from the pack.
DIFFUSERS_SCHEDULERS = {
    "dpmsolver++": ("DPMSolverMultistepScheduler", {}),
    "dpmsolver++_karras": ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True}),
    "dpmsolver++_sde": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_ancestral": ("EulerAncestralDiscreteScheduler", {}),
    "ddim": ("DDIMScheduler", {"clip_sample": False}),
    "unipc": ("UniPCMultistepScheduler", {}),
    "deis": ("DEISMultistepScheduler", {}),
}
# The bound of the oracle tests, relative to the latents' size (the tiny random model's latents are
# large, and dividing by the VAE scaling factor rounds).
RTOL = 1e-5


@pytest.fixture(scope="module")
def pipeline(tiny_folder):
    pipe = PixArtSigmaPipeline.from_pretrained(tiny_folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_with(pipeline, name: str) -> PixArtSigmaPipeline:
    class_name, settings = DIFFUSERS_SCHEDULERS[name]
    scheduler = getattr(diffusers, class_name).from_config(pipeline.scheduler.config, **settings)
    pipe = PixArtSigmaPipeline(**{**pipeline.components, "scheduler": scheduler})
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def init(tiny, reference):
    """A LATENT to start from (raw VAE space): a txt2img result at another seed."""
    settings = sampler_settings.SamplerSettings(tiny, width=SIZE, height=SIZE, steps=2, seed=99, **FP32)
    return sampler.sample(settings, reference.embeds)


def assert_close(ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() <= RTOL * expected.abs().max().item()


# --- schedulers -------------------------------------------------------------------------------------


def test_scheduler_names_are_the_documented_ones():
    assert tuple(DIFFUSERS_SCHEDULERS) == schedulers.SCHEDULERS
    assert schedulers.SCHEDULERS[0] == schedulers.DEFAULT_SCHEDULER == "dpmsolver++"


@pytest.mark.parametrize("name", schedulers.SCHEDULERS)
def test_every_scheduler_is_seeded_and_equals_diffusers_pipeline_with_it(tiny, reference, pipeline, name):
    """The ancestral and SDE ones too: the seed's generator draws the start noise, then each step's."""
    seed, steps, batch_size = 3, 2, 1

    def run(seed: int) -> torch.Tensor:
        settings = sampler_settings.SamplerSettings(
            tiny,
            width=SIZE,
            height=SIZE,
            steps=steps,
            seed=seed,
            batch_size=batch_size,
            scheduler=name,
            **FP32,
        )
        return sampler.sample(settings, reference.embeds)

    ours = run(seed)
    assert ours.shape == (batch_size, 4, SIZE // 8, SIZE // 8)
    assert torch.isfinite(ours).all()
    assert torch.equal(ours, run(seed)), "same seed, same latents"
    assert not torch.equal(ours, run(seed + 1)), "another seed, other latents"

    embeds = reference.embeds
    expected = pipeline_with(pipeline, name)(
        negative_prompt=None,
        prompt_embeds=embeds.prompt_embeds,
        prompt_attention_mask=embeds.prompt_mask,
        negative_prompt_embeds=embeds.negative_embeds,
        negative_prompt_attention_mask=embeds.negative_mask,
        generator=torch.Generator("cpu").manual_seed(seed),
        width=SIZE,
        height=SIZE,
        num_inference_steps=steps,
        guidance_scale=reference.settings["cfg"],
        num_images_per_prompt=batch_size,
        use_resolution_binning=False,
        output_type="latent",
    ).images
    assert_close(ours, expected / sampler.scaling_factor(tiny))


def test_unknown_scheduler(tiny, reference, load_spy):
    with pytest.raises(ValueError) as info:
        sampler.sample(
            sampler_settings.SamplerSettings(
                tiny, width=SIZE, height=SIZE, steps=2, scheduler="lms", device="cpu"
            ),
            reference.embeds,
        )
    message = str(info.value)
    assert "scheduler 'lms' is unknown" in message and all(name in message for name in schedulers.SCHEDULERS)
    assert load_spy.total() == 0


# --- resolution presets ----------------------------------------------------------------------------


BINS = {512: ASPECT_RATIO_512_BIN, 1024: ASPECT_RATIO_1024_BIN, 2048: ASPECT_RATIO_2048_BIN}


def test_presets_are_pixarts_bins_as_width_by_height():
    presets = resolutions.resolution_presets()
    expected = {
        (base, int(width), int(height)) for base, bins in BINS.items() for height, width in bins.values()
    }
    found = {(int(name.split(":")[0]), *size) for name, size in presets.items()}
    assert found == expected
    assert len(presets) == sum(map(len, BINS.values()))
    # The bins are keyed by height / width: the 0.78 bin of the 1024 model is landscape.
    assert resolutions.preset_size("1024: 1152×896 (1.29:1)", 64, 64) == (1152, 896)
    assert resolutions.preset_size("1024: 896×1152 (1:1.29)", 64, 64) == (896, 1152)
    assert resolutions.preset_size("512: 512×512 (1:1)", 64, 64) == (512, 512)
    assert resolutions.preset_size("2048: 4096×1024 (4.00:1)", 64, 64) == (4096, 1024)


@pytest.mark.parametrize("base", list(BINS))
def test_every_preset_is_a_valid_size_of_its_aspect(base):
    presets = {
        name: size for name, size in resolutions.resolution_presets().items() if name.startswith(f"{base}:")
    }
    ratios = {round(float(key), 2) for key in BINS[base]}
    for name, (width, height) in presets.items():
        contract.check_size("width", width)
        contract.check_size("height", height)
        assert round(height / width, 2) in ratios, name
        assert f"{width}×{height}" in name
        shown = name.rsplit("(", 1)[1].rstrip(")")
        wide, tall = (float(part) for part in shown.split(":"))
        assert width / height == pytest.approx(wide / tall, abs=0.01), name
        # Every preset holds about as many pixels as its model's square.
        assert 0.8 <= width * height / base**2 <= 1.1, name


def test_custom_resolution_keeps_width_and_height():
    assert resolutions.preset_size(resolutions.CUSTOM_RESOLUTION, 96, 64) == (96, 64)


def test_unknown_resolution():
    with pytest.raises(ValueError) as info:
        resolutions.preset_size("1000x1000", 64, 64)
    message = str(info.value)
    assert "resolution '1000x1000' is not a preset" in message and "'custom'" in message


# --- image-to-image -----------------------------------------------------------------------------------


def diffusers_img2img(pipeline, name, embeds, init, steps, kept, seed, cfg) -> torch.Tensor:
    """diffusers' image-to-image recipe (as in StableDiffusionImg2ImgPipeline): the full ``steps``-step
    schedule begun at step ``steps - kept`` with ``set_begin_index``, the init latents noised to that
    step's timestep; the denoising loop is PixArtSigmaPipeline's."""
    pipe = pipeline_with(pipeline, name)
    scheduler, scale = pipe.scheduler, pipe.vae.config.scaling_factor
    generator = torch.Generator("cpu").manual_seed(seed)
    noise = torch.randn(init.shape, generator=generator)
    scheduler.set_timesteps(steps)
    timesteps = scheduler.timesteps[steps - kept :]
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(steps - kept)
    latents = scheduler.add_noise(init * scale, noise, timesteps[:1])
    prompt = torch.cat([embeds.negative_embeds, embeds.prompt_embeds])
    mask = torch.cat([embeds.negative_mask, embeds.prompt_mask])
    step_kwargs = pipe.prepare_extra_step_kwargs(generator, eta=0.0)
    with torch.inference_mode():
        for t in timesteps:
            model_input = scheduler.scale_model_input(torch.cat([latents] * 2), t)
            prediction = pipe.transformer(
                model_input,
                encoder_hidden_states=prompt,
                encoder_attention_mask=mask,
                timestep=t[None].expand(2),
                added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                return_dict=False,
            )[0]
            uncond, cond = prediction.chunk(2)
            noise_pred = (uncond + cfg * (cond - uncond)).chunk(2, dim=1)[0]  # learned sigma dropped
            latents = scheduler.step(noise_pred, t, latents, **step_kwargs, return_dict=False)[0]
    return latents / scale


@pytest.mark.parametrize("name", schedulers.SCHEDULERS)
def test_img2img_equals_diffusers_recipe(tiny, reference, pipeline, init, name):
    """Short runs: from 15 steps on, DEIS picks its lower-order last step by the schedule's length, here
    the steps that run, in the recipe all of them."""
    steps, denoise, seed, cfg = 4, 0.5, 11, 4.5
    settings = sampler_settings.SamplerSettings(
        tiny, steps=steps, cfg=cfg, seed=seed, scheduler=name, denoise=denoise, **FP32
    )
    ours = sampler.sample(settings, reference.embeds, init_latents=init)
    kept = schedulers.steps_to_run(steps, denoise)
    assert kept == 2
    assert_close(ours, diffusers_img2img(pipeline, name, reference.embeds, init, steps, kept, seed, cfg))


def test_denoise_1_is_txt2img_of_the_latents_size(tiny, reference, init):
    """As ComfyUI's Empty Latent Image: the latent gives the size and batch, the start is pure noise, so
    its values do not matter; width and height are ignored."""
    settings = {"steps": 2, "seed": 4, "denoise": 1.0, **FP32}
    zeros = sampler.sample(
        sampler_settings.SamplerSettings(tiny, width=512, **settings),
        reference.embeds,
        init_latents=torch.zeros(1, 4, 8, 12),
    )
    image = torch.cat([init, init], dim=3)[..., :12]
    from_image = sampler.sample(
        sampler_settings.SamplerSettings(tiny, **settings), reference.embeds, init_latents=image
    )
    txt2img = sampler.sample(
        sampler_settings.SamplerSettings(tiny, width=96, height=64, **settings), reference.embeds
    )
    assert txt2img.shape == (1, 4, 8, 12)
    assert torch.equal(zeros, txt2img) and torch.equal(from_image, txt2img)


def test_denoise_0_returns_the_latent_without_loading(tiny, reference, init, load_spy):
    settings = sampler_settings.SamplerSettings(tiny, steps=4, denoise=0.0, device="cpu")
    ours = sampler.sample(settings, reference.embeds, init_latents=init)
    assert torch.equal(ours, init)
    assert load_spy.total() == 0


def test_less_denoise_stays_closer_to_the_latent(tiny, reference, init):
    def distance(denoise: float) -> float:
        settings = sampler_settings.SamplerSettings(tiny, steps=4, seed=2, denoise=denoise, **FP32)
        out = sampler.sample(settings, reference.embeds, init_latents=init)
        return (out - init).abs().mean().item()

    assert distance(0.25) < distance(0.5) < distance(1.0)


@pytest.mark.parametrize(
    ("latent_batch", "batch_size", "images"), [(1, 1, 1), (1, 3, 3), (2, 1, 2), (2, 2, 2)]
)
def test_latent_batch(tiny, reference, init, latent_batch, batch_size, images):
    latent = init.repeat(latent_batch, 1, 1, 1)
    for denoise in (0.0, 0.5):
        settings = sampler_settings.SamplerSettings(
            tiny, steps=2, batch_size=batch_size, denoise=denoise, **FP32
        )
        out = sampler.sample(settings, reference.embeds, init_latents=latent)
        assert out.shape == (images, 4, SIZE // 8, SIZE // 8)
        assert out.dtype == torch.float32 and out.device.type == "cpu"


def test_img2img_reports_the_steps_it_runs(tiny, reference, init):
    steps = []
    sampler.sample(
        sampler_settings.SamplerSettings(tiny, steps=10, denoise=0.3, **FP32),
        reference.embeds,
        init_latents=init,
        on_progress=lambda step, total, _latents: steps.append((step, total)),
    )
    assert steps == [(1, 3), (2, 3), (3, 3)]


@pytest.mark.parametrize(
    ("steps", "denoise", "kept"),
    [(4, 1.0, 4), (4, 0.5, 2), (20, 0.6, 12), (10, 0.35, 4), (3, 0.5, 2), (4, 0.01, 1), (4, 0.0, 0)],
)
def test_steps_to_run(steps, denoise, kept):
    assert schedulers.steps_to_run(steps, denoise) == kept


@pytest.mark.parametrize(
    ("inputs", "exc_type", "parts"),
    [
        pytest.param(
            {"init_latents": torch.zeros(1, 16, 8, 8)},
            ValueError,
            ("latent has shape (1, 16, 8, 8)", "[batch, 4, height/8, width/8]", "SDXL VAE"),
            id="16 channels",
        ),
        pytest.param(
            {"init_latents": torch.zeros(4, 8, 8)},
            ValueError,
            ("latent has shape (4, 8, 8)", "Empty Latent Image"),
            id="no batch dimension",
        ),
        pytest.param(
            {"init_latents": torch.zeros(1, 4, 8, 9)},
            ValueError,
            ("latent width 72", "not a multiple of 16", "64 or 80"),
            id="odd width",
        ),
        pytest.param(
            {"init_latents": torch.zeros(1, 4, 4, 8)},
            ValueError,
            ("latent height 32", "out of range", "64..4096"),
            id="too small",
        ),
        pytest.param(
            {"init_latents": {"samples": torch.zeros(1, 4, 8, 8)}},
            TypeError,
            ("latent", "'samples'", "dict"),
            id="the LATENT dict",
        ),
        pytest.param(
            {"denoise": 1.5}, ValueError, ("denoise 1.5", "out of range", "0.0..1.0"), id="denoise 1.5"
        ),
        pytest.param({"denoise": -0.1}, ValueError, ("denoise -0.1", "0.0..1.0"), id="denoise -0.1"),
        pytest.param({"denoise": float("nan")}, ValueError, ("denoise nan", "0.0..1.0"), id="denoise nan"),
        pytest.param({"denoise": "0.5"}, TypeError, ("denoise", "number", "'0.5'"), id="denoise text"),
        pytest.param(
            {"init_latents": None, "denoise": 0.5},
            ValueError,
            ("denoise 0.5", "needs a latent", "denoise to 1"),
            id="denoise without latent",
        ),
        pytest.param(
            {"init_latents": torch.zeros(3, 4, 8, 8), "batch_size": 2},
            ValueError,
            ("batch of 3", "batch_size is 2", "set batch_size to 1"),
            id="latent batch and batch_size",
        ),
    ],
)
def test_bad_img2img_inputs(tiny, reference, load_spy, inputs, exc_type, parts):
    settings = {
        "width": SIZE,
        "height": SIZE,
        "steps": 2,
        "device": "cpu",
        "init_latents": torch.zeros(1, 4, 8, 8),
    }
    settings = {**settings, **inputs}
    init_latents = settings.pop("init_latents")  # given to sample(); the rest are SamplerSettings
    with pytest.raises(exc_type) as info:
        sampler.sample(
            sampler_settings.SamplerSettings(tiny, **settings), reference.embeds, init_latents=init_latents
        )
    message = str(info.value)
    missing = [part for part in parts if part not in message]
    assert not missing, f"{missing} not in: {message}"
    assert load_spy.total() == 0
