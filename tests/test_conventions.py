"""The data passed between nodes: LATENT in raw VAE space, IMAGE [B,H,W,3] in 0..1, PIXART_EMBEDS
padded to 300 tokens — all float32 or masks on the CPU, as core/contract.py and
vae.decode state."""

from __future__ import annotations

import json

import torch

from pixart_lowvram.core import sampler, sampler_settings, text_encoder, vae
from pixart_lowvram.core.contract import PixArtEmbeds
from pixart_lowvram.core.text_encoder import MAX_TOKENS

FP32 = {"quantization": "none", "device": "cpu", "precision": torch.float32}


def test_latent_is_raw_vae_space(tiny, tiny_folder, reference):
    from diffusers import PixArtSigmaPipeline

    latents = reference.latents
    settings = reference.settings
    assert latents.dtype == torch.float32 and latents.device.type == "cpu"
    assert latents.shape == (1, 4, settings["height"] // 8, settings["width"] // 8)

    scaling = json.loads((tiny_folder / "vae" / "config.json").read_text())["scaling_factor"]
    assert scaling == 0.13025
    assert sampler.scaling_factor(tiny) == scaling

    pipe = PixArtSigmaPipeline.from_pretrained(tiny_folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    model_space = pipe(
        prompt=reference.prompt,
        negative_prompt=reference.negative,
        generator=torch.Generator("cpu").manual_seed(settings["seed"]),
        width=settings["width"],
        height=settings["height"],
        num_inference_steps=settings["steps"],
        guidance_scale=settings["cfg"],
        use_resolution_binning=False,
        clean_caption=False,
        output_type="latent",
    ).images
    torch.testing.assert_close(latents, model_space / scaling, rtol=1e-5, atol=1e-5)


def test_latent_shape_follows_size_and_batch(tiny, reference):
    settings = sampler_settings.SamplerSettings(tiny, width=96, height=64, steps=1, batch_size=3, **FP32)
    latents = sampler.sample(settings, reference.embeds)
    assert latents.shape == (3, 4, 8, 12)
    assert latents.dtype == torch.float32 and latents.device.type == "cpu"


def test_image_is_bhwc_float32_in_unit_range(reference):
    images = reference.images
    assert images.shape == (1, 64, 64, 3)
    assert images.dtype == torch.float32 and images.device.type == "cpu"
    assert images.min().item() >= 0.0 and images.max().item() <= 1.0


def test_decode_accepts_other_dtypes_and_returns_float32(tiny, reference):
    settings = vae.DecoderSettings(tiny, device="cpu", precision="bf16")
    images = vae.decode(settings, reference.latents.to(torch.bfloat16))
    assert images.shape == (1, 64, 64, 3) and images.dtype == torch.float32


def test_embeds_are_padded_cpu_tensors(tiny, reference):
    embeds = reference.embeds
    width = json.loads((tiny.path / "transformer" / "config.json").read_text())["caption_channels"]
    assert isinstance(embeds, PixArtEmbeds)
    assert embeds.prompt_embeds.shape == embeds.negative_embeds.shape == (1, MAX_TOKENS, width)
    assert embeds.prompt_mask.shape == embeds.negative_mask.shape == (1, MAX_TOKENS)
    for tensor in (embeds.prompt_embeds, embeds.prompt_mask, embeds.negative_embeds, embeds.negative_mask):
        assert tensor.device.type == "cpu"
    assert embeds.width == width and embeds.batch == 1
    assert embeds.dtype == torch.float32 and embeds.quantization == "none"
    assert embeds.model == tiny.key
    # The mask keeps the prompt's tokens (and the end token), then padding.
    kept = int(embeds.prompt_mask.sum())
    assert 1 < kept < MAX_TOKENS
    assert embeds.prompt_mask[0, :kept].all() and not embeds.prompt_mask[0, kept:].any()
    assert 1 <= int(embeds.negative_mask.sum()) < kept
    assert not torch.equal(embeds.prompt_embeds, embeds.negative_embeds)


def test_long_prompt_is_truncated_to_300_tokens(tiny):
    embeds = text_encoder.encode(text_encoder.EncoderSettings(tiny, **FP32), " ".join(["cat"] * 400))
    assert embeds.prompt_embeds.shape[1] == MAX_TOKENS
    assert int(embeds.prompt_mask.sum()) == MAX_TOKENS


def test_empty_prompt_and_negative_are_allowed(tiny):
    embeds = text_encoder.encode(text_encoder.EncoderSettings(tiny, **FP32), "", "")
    assert embeds.prompt_embeds.shape == (1, MAX_TOKENS, embeds.width)
    # The empty string still encodes its end token.
    assert int(embeds.prompt_mask.sum()) == int(embeds.negative_mask.sum()) == 1
    assert torch.isfinite(embeds.prompt_embeds).all()


def test_seed_noise_does_not_depend_on_precision(tiny, reference):
    """A seed gives the same image whatever the compute dtype (so the defaults — bf16 on the CPU, fp16
    on CUDA — agree with each other and with fp32). Measured latents cosine bf16 vs fp32: 0.99985.

    On torch 2.11, ``torch.randn(generator=cpu, dtype=bf16 or fp16)`` draws different numbers from
    fp32 (cosine ~0.06 here); drawing the noise in fp32 keeps the seed's meaning on every torch.
    """
    settings = sampler_settings.SamplerSettings(
        tiny, **reference.settings, quantization="none", device="cpu", precision=torch.bfloat16
    )
    latents = sampler.sample(settings, reference.embeds)
    cosine = torch.nn.functional.cosine_similarity(latents.flatten(), reference.latents.flatten(), dim=0)
    assert cosine.item() >= 0.999
