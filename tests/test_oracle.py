"""The oracle: with quantization off and fp32, encode -> sample -> decode is diffusers'
``PixArtSigmaPipeline``; with quantization on, the output stays close to that fp32 reference.

The quantized bounds were measured on the tiny random model (2 steps, 64 px, cfg 4.5, seed 7) on the
development CPU (bitsandbytes 0.50.2, optimum-quanto 0.2.7); each bound leaves a margin of several
times the measured error so other CPUs' kernels pass. Cosine similarities of embeddings count only
the tokens the mask keeps (padding is ignored by the transformer).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pixart_lowvram.core import sampler, sampler_settings, text_encoder, vae

SIZE = 64
FP32 = {"quantization": "none", "device": "cpu", "precision": torch.float32}


def cosine(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    a, b = a.float(), b.float()
    if mask is not None:
        a, b = a[mask.bool()], b[mask.bool()]
    return F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


@pytest.fixture(scope="module")
def pipeline(tiny_folder):
    from diffusers import PixArtSigmaPipeline

    pipe = PixArtSigmaPipeline.from_pretrained(tiny_folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize("cfg", [4.5, 1.0], ids=["cfg4.5", "no-guidance"])
def test_unquantized_chain_equals_diffusers_pipeline(tiny, pipeline, cfg, batch_size):
    prompt, negative, seed, steps = "a small dog on the street at night", "blurry", 1234, 3
    embeds = text_encoder.encode(text_encoder.EncoderSettings(tiny, **FP32), prompt, negative)
    sampling = sampler_settings.SamplerSettings(
        tiny,
        width=SIZE,
        height=SIZE,
        steps=steps,
        cfg=cfg,
        seed=seed,
        batch_size=batch_size,
        **FP32,
    )
    latents = sampler.sample(sampling, embeds)
    images = vae.decode(vae.DecoderSettings(tiny, device="cpu", precision=torch.float32), latents)

    expected = pipeline(
        prompt=prompt,
        negative_prompt=negative,
        generator=torch.Generator("cpu").manual_seed(seed),
        width=SIZE,
        height=SIZE,
        num_inference_steps=steps,
        guidance_scale=cfg,
        num_images_per_prompt=batch_size,
        use_resolution_binning=False,
        clean_caption=False,
        output_type="pt",
    ).images.permute(0, 2, 3, 1)

    assert images.shape == expected.shape == (batch_size, SIZE, SIZE, 3)
    assert (images - expected).abs().max().item() <= 1e-5
    # Guard against a vacuous oracle: the images are not flat.
    assert images.std().item() > 0.01


def test_unquantized_embeddings_equal_encode_prompt(tiny, pipeline, reference):
    expected = pipeline.encode_prompt(
        reference.prompt,
        negative_prompt=reference.negative,
        device="cpu",
        clean_caption=False,
        max_sequence_length=300,
    )
    got = (
        reference.embeds.prompt_embeds,
        reference.embeds.prompt_mask,
        reference.embeds.negative_embeds,
        reference.embeds.negative_mask,
    )
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


# Measured masked cosine vs fp32 (default dtype, bf16 on the CPU), prompt / negative:
# nf4 0.9881 / 0.9913, fp4 0.9803 / 0.9803, int8 0.99987 / 0.99991.
T5_BOUNDS = {"nf4": 0.97, "fp4": 0.95, "int8": 0.999}


@pytest.mark.filterwarnings("ignore:MatMul8bitLt")
@pytest.mark.parametrize("scheme", list(T5_BOUNDS))
def test_quantized_t5_close_to_fp32(tiny, reference, scheme):
    settings = text_encoder.EncoderSettings(tiny, quantization=scheme, device="cpu")
    embeds = text_encoder.encode(settings, reference.prompt, reference.negative)
    ref = reference.embeds
    assert embeds.prompt_embeds.shape == ref.prompt_embeds.shape
    assert embeds.negative_embeds.shape == ref.negative_embeds.shape
    assert torch.isfinite(embeds.prompt_embeds).all() and torch.isfinite(embeds.negative_embeds).all()
    assert torch.equal(embeds.prompt_mask, ref.prompt_mask)
    assert scheme in embeds.quantization
    assert cosine(embeds.prompt_embeds, ref.prompt_embeds, ref.prompt_mask) >= T5_BOUNDS[scheme]
    assert cosine(embeds.negative_embeds, ref.negative_embeds, ref.negative_mask) >= T5_BOUNDS[scheme]


# The transformer computes in fp32 here, so the figures are the quantization's own error (bf16's
# share is in the default-chain test below). Measured vs fp32 (fp32 embeddings in): latents cosine /
# image mean abs diff — qint8 0.999998 / 0.00026, qfloat8 0.99989 / 0.0018.
TRANSFORMER_BOUNDS = {"qint8": (0.9999, 0.002), "qfloat8": (0.999, 0.01)}


@pytest.mark.parametrize("scheme", list(TRANSFORMER_BOUNDS))
def test_quantized_transformer_close_to_fp32(tiny, reference, scheme):
    min_cosine, max_mean_diff = TRANSFORMER_BOUNDS[scheme]
    settings = sampler_settings.SamplerSettings(
        tiny, **reference.settings, quantization=scheme, device="cpu", precision=torch.float32
    )
    latents = sampler.sample(settings, reference.embeds)
    images = vae.decode(vae.DecoderSettings(tiny, device="cpu", precision=torch.float32), latents)
    assert latents.shape == reference.latents.shape and latents.dtype == torch.float32
    assert images.shape == reference.images.shape
    assert torch.isfinite(latents).all() and torch.isfinite(images).all()
    assert cosine(latents, reference.latents) >= min_cosine
    assert (images - reference.images).abs().mean().item() <= max_mean_diff
    assert not torch.equal(latents, reference.latents), "the weights were quantized"


def test_default_quantized_chain_close_to_fp32(tiny, reference):
    """All defaults (T5 nf4 in bf16, transformer qint8 in bf16, VAE fp32 on the CPU).

    Measured: embeddings masked cosine 0.9881, latents cosine 0.99952, image mean abs diff 0.0037
    (max 0.022). Bounds: 0.97, 0.995, 0.02. This holds only while the seed's noise does not depend
    on the compute dtype (see test_conventions.py::test_seed_noise_does_not_depend_on_precision).
    """
    embeds = text_encoder.encode(
        text_encoder.EncoderSettings(tiny, device="cpu"), reference.prompt, reference.negative
    )
    latents = sampler.sample(
        sampler_settings.SamplerSettings(tiny, **reference.settings, device="cpu"), embeds
    )
    images = vae.decode(vae.DecoderSettings(tiny, device="cpu"), latents)
    assert embeds.quantization == "bitsandbytes nf4"
    assert images.shape == reference.images.shape and images.dtype == torch.float32
    assert torch.isfinite(images).all()
    assert cosine(embeds.prompt_embeds, reference.embeds.prompt_embeds, reference.embeds.prompt_mask) >= 0.97
    assert cosine(latents, reference.latents) >= 0.995
    assert (images - reference.images).abs().mean().item() <= 0.02
