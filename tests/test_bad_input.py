"""Bad input in core: every numeric setting at its bounds is accepted and just beyond them refused before
anything loads; a size far from the model's own warns; an empty prompt encodes; a prompt past 300 tokens
is cut with a warning; a non-tensor where a latent is expected is named.

Covered in test_errors.py: sizes not a multiple of 16, the other numeric inputs beyond their bounds through
sample(), embeds of another encoder width, a LATENT of the wrong channel count, quantization names the
backend cannot do on this device. The server's validation of the same inputs: test_comfyui_faults.py."""

from __future__ import annotations

import pytest
import torch

from pixart_lowvram.core import contract, sampler, sampler_settings, text_encoder, vae

FP32 = {"quantization": "none", "device": "cpu", "precision": torch.float32}
DEFAULTS = {"width": 64, "height": 64, "steps": 2, "cfg": 4.5, "seed": 0, "batch_size": 1}
AT_BOUNDS = [
    ("width", contract.MIN_SIZE),
    ("width", contract.MAX_SIZE),
    ("height", contract.MIN_SIZE),
    ("height", contract.MAX_SIZE),
    ("steps", 1),
    ("steps", sampler_settings.MAX_STEPS),
    ("cfg", 0.0),
    ("cfg", sampler_settings.MAX_CFG),
    ("seed", 0),
    ("seed", sampler_settings.MAX_SEED),
    ("batch_size", 1),
    ("batch_size", sampler_settings.MAX_BATCH),
]
BEYOND = [
    ("width", contract.MIN_SIZE - contract.SIZE_MULTIPLE, "out of range"),
    ("width", contract.MAX_SIZE + contract.SIZE_MULTIPLE, "out of range"),
    ("height", contract.MAX_SIZE + contract.SIZE_MULTIPLE, "out of range"),
    ("steps", sampler_settings.MAX_STEPS + 1, "out of range"),
    ("steps", 2.5, "whole number"),
    ("cfg", sampler_settings.MAX_CFG + 0.01, "out of range"),
    ("cfg", float("inf"), "out of range"),
    ("seed", 1.0, "whole number"),
    ("batch_size", True, "whole number"),
    ("batch_size", "4", "whole number"),
]


@pytest.mark.parametrize(("name", "value"), AT_BOUNDS)
def test_numeric_settings_at_their_bounds_are_accepted(tiny, name, value):
    sampler_settings.SamplerSettings(tiny, **{**DEFAULTS, name: value}, **FP32)


@pytest.mark.parametrize(("name", "value", "problem"), BEYOND)
def test_numeric_settings_beyond_their_bounds_are_refused_before_loading(
    tiny, reference, load_spy, name, value, problem
):
    with pytest.raises((TypeError, ValueError)) as info:
        sampler.sample(
            sampler_settings.SamplerSettings(tiny, **{**DEFAULTS, name: value}, **FP32), reference.embeds
        )
    message = str(info.value)
    assert message.startswith(name) and problem in message, message
    assert load_spy.total() == 0


@pytest.mark.parametrize("denoise", [0.0, 0.5, 1.0])
def test_denoise_at_and_within_its_bounds(denoise):
    sampler.check_denoise(denoise, has_latent=True)


@pytest.mark.parametrize("denoise", [-0.01, 1.01, float("nan"), "1"])
def test_denoise_beyond_its_bounds_is_refused_before_loading(tiny, reference, load_spy, denoise):
    with pytest.raises((TypeError, ValueError)) as info:
        sampler.sample(
            sampler_settings.SamplerSettings(tiny, **DEFAULTS, denoise=denoise, **FP32),
            reference.embeds,
            init_latents=reference.latents,
        )
    assert str(info.value).startswith("denoise"), info.value
    assert load_spy.total() == 0


def test_denoise_zero_returns_the_latent_without_loading(tiny, reference, load_spy):
    latents = sampler.sample(
        sampler_settings.SamplerSettings(tiny, **DEFAULTS, denoise=0.0, **FP32),
        reference.embeds,
        init_latents=reference.latents,
    )
    assert torch.equal(latents, reference.latents)
    assert load_spy.total() == 0


# --- a size far from the model's own -------------------------------------------------------------


@pytest.mark.parametrize(
    ("width", "height", "native", "warns"),
    [
        (2048, 2048, 512, True),  # a 2K size on the 512 model
        (1024, 1024, 512, True),
        (2048, 1024, 1024, False),
        (1024, 1024, 1024, False),
        (768, 768, 1024, False),
        (512, 512, 1024, True),
        (512, 512, 2048, True),
    ],
)
def test_size_warning(width, height, native, warns):
    warning = sampler.size_warning(width, height, native)
    assert (warning is not None) == warns
    if warns:
        assert f"{width}×{height}" in warning and f"native {native}×{native}" in warning
        assert "resolution 'native'" in warning


def test_a_size_far_from_the_models_own_warns_and_runs(tiny, reference, caplog):
    # The tiny model's native size is 64 px: 256² is 16× its area, as 2048² is on the 512 model.
    assert tiny.native_size == 64
    warnings: list[str] = []
    latents = sampler.sample(
        sampler_settings.SamplerSettings(tiny, **{**DEFAULTS, "width": 256, "height": 256}, **FP32),
        reference.embeds,
        on_warning=warnings.append,
    )
    assert latents.shape == (1, 4, 32, 32) and torch.isfinite(latents).all()
    [warning] = warnings
    assert "256×256" in warning and "native 64×64" in warning
    assert warning in caplog.text

    warnings.clear()
    sampler.sample(
        sampler_settings.SamplerSettings(tiny, **DEFAULTS, **FP32),
        reference.embeds,
        on_warning=warnings.append,
    )
    assert warnings == []


# --- prompts ------------------------------------------------------------------------------------------


def test_empty_prompt_encodes_as_the_empty_string(tiny):
    warnings: list[str] = []
    embeds = text_encoder.encode(
        text_encoder.EncoderSettings(tiny, **FP32), "", "", on_warning=warnings.append
    )
    assert embeds.prompt_embeds.shape[1] == text_encoder.MAX_TOKENS
    # Only the end-of-text token is attended to.
    assert embeds.prompt_mask.sum().item() == 1 and embeds.negative_mask.sum().item() == 1
    assert torch.isfinite(embeds.prompt_embeds).all()
    assert warnings == []


def long_text(words: int) -> str:
    return " ".join(f"red{i} cat" for i in range(words))


@pytest.mark.parametrize("which", ["prompt", "negative_prompt"])
def test_prompt_past_300_tokens_is_cut_with_a_warning(tiny, which, caplog):
    text = long_text(200)
    warnings: list[str] = []
    texts = {"prompt": "a cat", "negative_prompt": "", which: text}
    settings = text_encoder.EncoderSettings(tiny, **FP32)
    embeds = text_encoder.encode(
        settings, texts["prompt"], texts["negative_prompt"], on_warning=warnings.append
    )
    [warning] = warnings
    assert warning.startswith(f"{which} is ") and "T5 reads the first 300" in warning, warning
    assert "red199 cat" in warning or "…" in warning  # the dropped end is quoted
    assert f"Shorten the {which}" in warning
    assert warning in caplog.text
    mask = embeds.prompt_mask if which == "prompt" else embeds.negative_mask
    assert mask.sum().item() == text_encoder.MAX_TOKENS

    # What was cut does not change the embeddings.
    texts[which] = text + " and a dog"
    longer = text_encoder.encode(settings, texts["prompt"], texts["negative_prompt"])
    assert torch.equal(longer.prompt_embeds, embeds.prompt_embeds)
    assert torch.equal(longer.negative_embeds, embeds.negative_embeds)


def test_prompt_of_exactly_300_tokens_is_not_cut(tiny):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny.path / "tokenizer")
    words = [f"w{i}" for i in range(400)]
    # The longest prefix that is 300 tokens with the end token.
    fitting = max(n for n in range(1, 400) if len(tokenizer(" ".join(words[:n])).input_ids) <= 300)
    assert text_encoder.truncation_warning(tokenizer, "prompt", " ".join(words[:fitting])) is None
    assert text_encoder.truncation_warning(tokenizer, "prompt", " ".join(words[: fitting + 1])) is not None


# --- a non-tensor where a tensor is expected ---------------------------------------------------------


@pytest.mark.parametrize("samples", [None, [[0.0]], {"samples": None}, "latent"])
def test_decode_of_a_non_tensor_names_the_latent(tiny, load_spy, samples):
    with pytest.raises(TypeError) as info:
        vae.decode(vae.DecoderSettings(tiny, device="cpu"), samples)
    assert "latent must hold a tensor under 'samples'" in str(info.value)
    assert type(samples).__name__ in str(info.value)
    assert load_spy.total() == 0


@pytest.mark.parametrize("prompt", [None, 3, ["a cat"]])
def test_a_prompt_that_is_not_text(tiny, load_spy, prompt):
    with pytest.raises(TypeError, match="prompt must be text"):
        text_encoder.encode(text_encoder.EncoderSettings(tiny, **FP32), prompt, "")
    assert load_spy.total() == 0
