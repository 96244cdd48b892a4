"""T5 quantized whole (the default) or as the recipe (wo left in bf16): which layers get quantized,
and that the encoder's output stays close to the unquantized one either way."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch

from pixart_lowvram.core import text_encoder

CPU = torch.device("cpu")


def load(tiny, scheme: str):
    return text_encoder._load(
        text_encoder.EncoderSettings(tiny, quantization=scheme, device=CPU, precision=torch.bfloat16)
    )


def feed_forwards(model):
    return [block.layer[-1].DenseReluDense for block in model.encoder.block]


@pytest.mark.parametrize(
    ("scheme", "wo_type"),
    [
        ("nf4", bnb.nn.Linear4bit),
        ("fp4", bnb.nn.Linear4bit),
        ("nf4-recipe", torch.nn.Linear),
        ("int8", torch.nn.Linear),
    ],
)
def test_which_schemes_quantize_wo(tiny, scheme, wo_type):
    model = load(tiny, scheme)
    for ff in feed_forwards(model):
        assert type(ff.wo) is wo_type
        assert isinstance(ff.wi_0, bnb.nn.Linear4bit if "4" in scheme else bnb.nn.Linear8bitLt)
    if wo_type is torch.nn.Linear:
        assert all(ff.wo.weight.dtype == torch.bfloat16 for ff in feed_forwards(model))


def test_quantized_wo_sees_real_activations(tiny, reference):
    """A packed 4-bit wo has uint8 weights; T5's own feed-forward would cast its activations to that.
    Real-token cosine vs the fp32 encoder, measured 0.982 for nf4 (wo quantized) and 0.983 for the
    recipe; a uint8 cast gives about 0.02."""
    mask = reference.embeds.prompt_mask[0].bool()
    for scheme in ("nf4", "nf4-recipe"):
        settings = text_encoder.EncoderSettings(tiny, quantization=scheme)
        embeds = text_encoder.encode(settings, reference.prompt, reference.negative)
        got, want = embeds.prompt_embeds[0][mask].float(), reference.embeds.prompt_embeds[0][mask]
        assert torch.isfinite(got).all()
        assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) >= 0.97, scheme


def test_unquantized_t5_keeps_transformers_class(tiny):
    # Only quantizing schemes that take wo need the modified class.
    model = load(tiny, "none")
    assert type(model).__name__ == "T5EncoderModel"
