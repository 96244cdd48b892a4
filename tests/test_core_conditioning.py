"""Quantized T5 Encode's CONDITIONING outputs have the form ComfyUI core's PixArt text encoder gives:
every token of the prompt including the end token, no padding, float32, pooled_output None; an empty
negative is the end token alone. Their values are T5's output for the unpadded tokens with no mask,
which is how core runs T5."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, T5EncoderModel

from pixart_lowvram.core import text_encoder
from pixart_lowvram.core.conditioning import core_conditioning

FP32 = {"quantization": "none", "device": "cpu", "precision": torch.float32}


@pytest.fixture(scope="module")
def t5(tiny_folder):
    tokenizer = AutoTokenizer.from_pretrained(tiny_folder, subfolder="tokenizer")
    model = T5EncoderModel.from_pretrained(tiny_folder, subfolder="text_encoder", dtype=torch.float32).eval()
    return tokenizer, model


def unpadded_t5(t5, text: str) -> torch.Tensor:
    """What core computes: the prompt's tokens and its end token, no padding, no attention mask."""
    tokenizer, model = t5
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.inference_mode():
        return model(input_ids=ids).last_hidden_state


@pytest.mark.parametrize(
    ("prompt", "negative"), [("a photo of a red cat in a garden", ""), ("dog", "dark blue")]
)
def test_conditioning_is_the_unpadded_tokens(tiny, t5, prompt, negative):
    embeds = text_encoder.encode(text_encoder.EncoderSettings(tiny, **FP32), prompt, negative)
    positive, negative_cond = core_conditioning(embeds)
    for cond, text, mask in (
        (positive, prompt, embeds.prompt_mask),
        (negative_cond, negative, embeds.negative_mask),
    ):
        ((tensor, options),) = cond
        tokens = len(t5[0](text).input_ids)
        assert (
            tensor.shape == (1, tokens, embeds.width) and tokens == int(mask.sum()) < text_encoder.MAX_TOKENS
        )
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        assert options == {"pooled_output": None}
        torch.testing.assert_close(tensor, unpadded_t5(t5, text), rtol=1e-5, atol=1e-5)


def test_an_empty_negative_is_the_end_token_alone(tiny, t5):
    _positive, negative = core_conditioning(
        text_encoder.encode(text_encoder.EncoderSettings(tiny, **FP32), "a cat", "")
    )
    assert negative[0][0].shape[1] == 1
    assert t5[0]("").input_ids == [t5[0].eos_token_id]


def test_nf4_conditioning_is_close_to_the_unquantized(tiny, t5):
    embeds = text_encoder.encode(
        text_encoder.EncoderSettings(tiny, quantization="nf4", device="cpu"), "a photo of a red cat"
    )
    ((tensor, _),) = core_conditioning(embeds)[0]
    want = unpadded_t5(t5, "a photo of a red cat")
    assert tensor.shape == want.shape
    assert torch.nn.functional.cosine_similarity(tensor.flatten(), want.flatten(), dim=0) > 0.95


def test_only_pack_embeddings_are_taken():
    with pytest.raises(TypeError, match="PIXART_EMBEDS"):
        core_conditioning({"prompt_embeds": torch.zeros(1, 300, 64)})
