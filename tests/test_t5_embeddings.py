"""T5 encodes a text once: each text's embeddings are remembered with the model, so a negative prompt seen
before is not encoded again, and a prompt whose texts were both seen does not load T5 at all. The remembered
embeddings are the same bits the model makes (a negative prompt is encoded exactly as a prompt is); Free VRAM
forgets them, and a change of model, quantization or tokenizer does not reuse them."""

from __future__ import annotations

import pytest
import torch

from pixart_lowvram.core import text_encoder
from pixart_lowvram.core.pool import MAX_RESULTS, cache, free_all


@pytest.fixture
def encoded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The texts T5 itself encoded, in order."""
    texts: list[str] = []
    original = text_encoder._encode_text

    def spy(text_encoder_model, tokenizer, text, device):
        texts.append(text)
        return original(text_encoder_model, tokenizer, text, device)

    monkeypatch.setattr(text_encoder, "_encode_text", spy)
    return texts


def encode(tiny, prompt: str, negative: str = "", **options):
    settings = text_encoder.EncoderSettings(tiny, device="cpu", **options)
    return text_encoder.encode(settings, prompt, negative)


def test_the_same_texts_again_load_nothing_and_give_the_same_bits(tiny, load_spy, encoded):
    first = encode(tiny, "a red cat", "blurry")
    assert encoded == ["a red cat", "blurry"] and load_spy.count("text_encoder") == 1
    second = encode(tiny, "a red cat", "blurry")
    assert encoded == ["a red cat", "blurry"], "nothing encoded again"
    assert load_spy.count("text_encoder") == 1 and cache.pooled() == [], "T5 not even taken from host memory"
    for name in ("prompt_embeds", "prompt_mask", "negative_embeds", "negative_mask"):
        assert torch.equal(getattr(first, name), getattr(second, name)), name


def test_a_new_prompt_encodes_only_itself(tiny, encoded):
    encode(tiny, "a red cat")
    with_remembered = encode(tiny, "a lighthouse at dusk")
    assert encoded == ["a red cat", "", "a lighthouse at dusk"]
    cache.forget_results()
    fresh = encode(tiny, "a lighthouse at dusk")
    for name in ("prompt_embeds", "prompt_mask", "negative_embeds", "negative_mask"):
        assert torch.equal(getattr(with_remembered, name), getattr(fresh, name)), name


def test_a_negative_prompt_is_encoded_exactly_as_a_prompt(tiny):
    """What lets one remembered text serve either place: diffusers' negative path and its prompt path give
    the same bits for the same text (the same computation: same tokens, mask and call)."""
    as_negative = encode(tiny, "a red cat", "a lighthouse at dusk")
    cache.forget_results()
    as_prompt = encode(tiny, "a lighthouse at dusk", "a red cat")
    assert torch.equal(as_negative.negative_embeds, as_prompt.prompt_embeds)
    assert torch.equal(as_negative.negative_mask, as_prompt.prompt_mask)
    assert torch.equal(as_negative.prompt_embeds, as_prompt.negative_embeds)


def test_the_same_text_in_both_places_is_encoded_once(tiny, encoded):
    embeds = encode(tiny, "a red cat", "a red cat")
    assert encoded == ["a red cat"]
    assert torch.equal(embeds.prompt_embeds, embeds.negative_embeds)


def test_changing_what_was_handed_out_leaves_the_remembered_embeddings_alone(tiny):
    first = encode(tiny, "a red cat")
    kept = first.prompt_embeds.clone()
    with torch.inference_mode():  # the stage's tensors are inference tensors
        first.prompt_embeds.zero_()
    assert torch.equal(encode(tiny, "a red cat").prompt_embeds, kept)


def test_another_quantization_or_tokenizer_does_not_reuse_them(tiny, tiny_folder, tmp_path, encoded):
    encode(tiny, "a red cat")
    encode(tiny, "a red cat", quantization="none")
    assert encoded == ["a red cat", "", "a red cat", ""], "another model: encoded again"
    # The same T5 with another tokenizer folder (a copy: same files, other place) is another key too.
    import shutil

    from pixart_lowvram.core.models import resolve_model

    borrowed = tmp_path / "model"
    shutil.copytree(tiny_folder, borrowed, ignore=shutil.ignore_patterns("tokenizer"))
    encode(resolve_model(str(borrowed)), "a red cat", tokenizer_fallback=tiny_folder / "tokenizer")
    assert encoded[4:] == ["a red cat", ""]


def test_free_vram_forgets_them_and_only_the_latest_are_kept(tiny, encoded):
    encode(tiny, "a red cat")
    free_all()
    encode(tiny, "a red cat")
    assert encoded == ["a red cat", "", "a red cat", ""]
    for index in range(MAX_RESULTS):
        encode(tiny, f"prompt {index}")
    encoded.clear()
    encode(tiny, "a red cat")
    assert encoded == ["a red cat"], "the oldest text was forgotten, the negative (used every time) was not"
