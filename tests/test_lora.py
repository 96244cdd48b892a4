"""LoRAs on the transformer's int8 weights (core.lora): read in each key format ComfyUI reads, added at run
time to the weight each quantized layer expands, stacked, at strength 0 left out, and gone after the run;
the sampler with a LoRA against diffusers' pipeline with the same LoRA merged into fp32 weights."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pixart_lowvram.cli.random_model import LORA_FORMATS, LORA_LAYERS, save_random_lora
from pixart_lowvram.core import lora, sampler, sampler_settings, text_encoder
from pixart_lowvram.core.quant.quanto import ScaledWeightLinear, dense_weights
from pixart_lowvram.core.transformer import quantized_transformer

SIZE = 64
FP32 = {"device": "cpu", "precision": torch.float32}
LAYER = "transformer_blocks.0.attn1.to_q"


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0).item()


@pytest.fixture(scope="module")
def quantized(tiny):
    return quantized_transformer(
        sampler_settings.SamplerSettings(tiny, quantization="qint8", **FP32).transformer
    )


def lora_file(tiny_folder, tmp_path, form="peft", seed=0, **kwargs):
    return save_random_lora(
        tiny_folder, tmp_path / f"{form}-{seed}.safetensors", form=form, seed=seed, **kwargs
    )


def expected_delta(path, layer: str, strength: float) -> torch.Tensor:
    """The delta a LoRA file gives ``layer``, worked out from its tensors as the formats define it."""
    state = load_file(path)
    for prefix, up, down, _alpha in LORA_FORMATS.values():
        stem = prefix + layer
        if stem + up in state:
            rank = state[stem + down].shape[0]
            alpha = state[stem + ".alpha"].item() if stem + ".alpha" in state else rank
            return strength * alpha / rank * state[stem + up].float() @ state[stem + down].float()
    raise AssertionError(f"{layer} not in {path}")


@pytest.mark.parametrize("form", list(LORA_FORMATS))
def test_a_lora_adds_its_delta_to_the_expanded_int8_weight(quantized, tiny_folder, tmp_path, form):
    path = lora_file(tiny_folder, tmp_path, form)
    layer = quantized.get_submodule(LAYER)
    assert isinstance(layer, ScaledWeightLinear) and layer.weight.dtype == torch.int8
    plain = layer.expanded()
    x = torch.randn(3, layer.in_features)
    with lora.applied(quantized, [lora.LoraSpec(path, 0.7)]) as count:
        assert count == len(quantized.transformer_blocks) * 10
        got = layer(x)
        assert layer.weight.dtype == torch.int8  # the stored weight is never rewritten
    want = F.linear(x, plain + expected_delta(path, LAYER, 0.7), layer.bias)
    torch.testing.assert_close(got, want)  # fp32: torch's default tolerance
    # Not vacuous: the LoRA moves the output well beyond that tolerance.
    assert (layer(x) - got).abs().max() > 1e-3


def test_after_the_run_the_model_is_as_it_was_and_strength_zero_is_left_out(quantized, tiny_folder, tmp_path):
    path = lora_file(tiny_folder, tmp_path)
    x = torch.randn(2, 4, 8, 8)
    t, caption = torch.tensor([500, 500]), torch.randn(2, 5, 64)
    before = quantized(x, encoder_hidden_states=caption, timestep=t, return_dict=False)[0]
    with lora.applied(quantized, [lora.LoraSpec(path, 1.0)]):
        during = quantized(x, encoder_hidden_states=caption, timestep=t, return_dict=False)[0]
    with lora.applied(quantized, [lora.LoraSpec(path, 0.0)]) as count:
        assert count == 0
        zero = quantized(x, encoder_hidden_states=caption, timestep=t, return_dict=False)[0]
    after = quantized(x, encoder_hidden_states=caption, timestep=t, return_dict=False)[0]
    # The same computation on the same weights: bit for bit.
    assert torch.equal(before, after) and torch.equal(before, zero)
    assert not torch.allclose(before, during, atol=1e-4)


def test_loras_stack(quantized, tiny_folder, tmp_path):
    first, second = (
        lora_file(tiny_folder, tmp_path, seed=1),
        lora_file(tiny_folder, tmp_path, "kohya", seed=2),
    )
    layer = quantized.get_submodule(LAYER)
    plain = layer.expanded()
    with lora.applied(quantized, [lora.LoraSpec(first, 1.0), lora.LoraSpec(second, -0.5)]):
        stacked = layer.expanded()
    want = plain + expected_delta(first, LAYER, 1.0) + expected_delta(second, LAYER, -0.5)
    torch.testing.assert_close(stacked, want)


def test_dense_weights_hold_the_lora(quantized, tiny_folder, tmp_path):
    path = lora_file(tiny_folder, tmp_path)
    layer = quantized.get_submodule(LAYER)
    x = torch.randn(3, layer.in_features)
    with lora.applied(quantized, [lora.LoraSpec(path, 1.0)]):
        per_call = layer(x)
        with dense_weights(quantized):
            dense = layer(x)
    # The same expansion and sum, once held and once per call: the same numbers.
    assert torch.equal(dense, per_call)


def test_a_lora_of_another_model_is_named_with_how_many_layers_matched(quantized, tiny_folder, tmp_path):
    path = lora_file(tiny_folder, tmp_path, blocks=1)
    state = load_file(path)
    foreign = {key.replace("transformer_blocks.0.", "down_blocks.0.", 1): v for key, v in state.items()}
    save_file(foreign, tmp_path / "sdxl.safetensors")
    partial = {**state, **{k: v.clone() for k, v in foreign.items() if "attn1" in k}}
    save_file(partial, tmp_path / "partial.safetensors")
    warnings: list[str] = []
    with lora.applied(quantized, [lora.LoraSpec(tmp_path / "sdxl.safetensors")], warnings.append) as count:
        assert count == 0
    with lora.applied(quantized, [lora.LoraSpec(tmp_path / "partial.safetensors")], warnings.append) as count:
        assert count == 10
    assert warnings[0].startswith("LoRA sdxl.safetensors: none of its 10 layers match")
    assert warnings[1].startswith("LoRA partial.safetensors: 10 of its 14 layers match")


def test_bad_lora_inputs_get_clear_errors(tiny_folder, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        lora.LoraSpec(tmp_path / "missing.safetensors")
    (tmp_path / "x.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"not a \.safetensors file"):
        lora.LoraSpec(tmp_path / "x.pt")
    path = lora_file(tiny_folder, tmp_path)
    with pytest.raises(ValueError, match="out of range"):
        lora.LoraSpec(path, 11)
    assert lora.LoraSpec.parse(f"{path}:0.5").strength == 0.5
    assert lora.LoraSpec.parse(str(path)).strength == 1.0
    # A colon in the file's own name is the file's, not a strength.
    named = tmp_path / "style:v2.safetensors"
    named.write_bytes(path.read_bytes())
    assert lora.LoraSpec.parse(str(named)) == lora.LoraSpec(named, 1.0)
    assert lora.LoraSpec.parse(f"{named}:0.5") == lora.LoraSpec(named, 0.5)


@pytest.mark.parametrize("name", ["somefile", "missing.safetensors", "x.pt", "C:/loras/style.safetensors"])
def test_a_strength_that_is_no_number_is_named_whatever_the_file(tmp_path, name):
    text = f"{tmp_path / name if not name.startswith('C:') else name}:abc"
    with pytest.raises(ValueError) as error:
        lora.LoraSpec.parse(text)
    assert str(error.value).startswith(f"--lora {text!r}: the strength 'abc' is not a number; give FILE or")


def not_a_lora(tmp_path: Path) -> Path:
    save_file({"a": torch.zeros(1)}, tmp_path / "empty.safetensors")
    return tmp_path / "empty.safetensors"


def test_a_file_that_is_not_a_lora_is_refused_when_named(tmp_path):
    """From the header alone, when the LoraSpec is made (the command line's --lora, the LoRA node)."""
    with pytest.raises(
        ValueError, match=r"LoRA empty\.safetensors holds no LoRA layers .* among its 1 tensors"
    ):
        lora.LoraSpec(not_a_lora(tmp_path))
    (tmp_path / "cut.safetensors").write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(
        ValueError, match=r"LoRA cut\.safetensors is not a readable safetensors file .* download it"
    ):
        lora.LoraSpec(tmp_path / "cut.safetensors")


def test_a_bad_lora_on_the_command_line_stops_before_any_model_loads(tiny_folder, tmp_path, load_spy, capsys):
    from pixart_lowvram.cli import main as cli

    path = not_a_lora(tmp_path)
    argv = ["generate", "--model", str(tiny_folder), "--device", "cpu", "--out", str(tmp_path / "out")]
    assert cli.main([*argv, "--lora", str(path)]) == 2
    err = capsys.readouterr().err
    with pytest.raises(ValueError) as expected:
        lora.check_file(path)
    assert err == f"error: {expected.value}\n"
    assert load_spy.total() == 0 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("quantization", ["none", "qint8"])
def test_sampler_with_a_lora_against_diffusers_with_it_merged(tiny, tiny_folder, tmp_path, quantization):
    """The oracle: diffusers' pipeline on fp32 weights with the LoRA merged into them."""
    from diffusers import PixArtSigmaPipeline

    path = lora_file(tiny_folder, tmp_path, "kohya", scale=0.15)
    prompt, seed, steps = "a red apple on a table", 5, 3
    embeds = text_encoder.encode(text_encoder.EncoderSettings(tiny, quantization="none", **FP32), prompt)
    settings = sampler_settings.SamplerSettings(
        tiny, width=SIZE, height=SIZE, steps=steps, seed=seed, quantization=quantization, **FP32
    )
    with_lora = sampler.sample(dataclasses.replace(settings, loras=(lora.LoraSpec(path, 0.8),)), embeds)
    without = sampler.sample(settings, embeds)

    pipe = PixArtSigmaPipeline.from_pretrained(tiny_folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        for name, module in pipe.transformer.named_modules():
            parts = name.split(".", 2)
            if parts[0] == "transformer_blocks" and len(parts) == 3 and parts[2] in LORA_LAYERS:
                module.weight += expected_delta(path, name, 0.8)
    merged = pipe(
        negative_prompt=None,
        prompt_embeds=embeds.prompt_embeds,
        prompt_attention_mask=embeds.prompt_mask,
        negative_prompt_embeds=embeds.negative_embeds,
        negative_prompt_attention_mask=embeds.negative_mask,
        generator=torch.Generator("cpu").manual_seed(seed),
        width=SIZE,
        height=SIZE,
        num_inference_steps=steps,
        use_resolution_binning=False,
        output_type="latent",
    ).images / sampler.scaling_factor(tiny)
    assert cosine(with_lora, without) < 0.999  # the LoRA matters
    if quantization == "none":
        # The same fp32 arithmetic but for the order of the LoRA's sum (into the weight once, or per call).
        torch.testing.assert_close(with_lora, merged, rtol=1e-4, atol=1e-4 * merged.abs().max().item())
    else:
        assert cosine(with_lora, merged) >= 0.999


def test_generate_takes_loras_on_the_command_line(tiny_folder, tmp_path, capsys):
    from pixart_lowvram.cli import main as cli

    path = lora_file(tiny_folder, tmp_path, scale=0.15)
    base = ["generate", "--model", str(tiny_folder), "--steps", "2", "--device", "cpu", "--no-snapshot"]

    def image(name: str, *loras: str) -> bytes:
        assert cli.main([*base, "--out", str(tmp_path / name), "--prefix", "x", *loras]) == 0
        return (tmp_path / name / "x_00001.png").read_bytes()

    plain = image("plain")
    assert image("zero", "--lora", f"{path}:0") == plain  # left out: the same computation
    assert image("one", "--lora", str(path)) != plain
    assert image("two", "--lora", f"{path}:0.5", "--lora", f"{path}:0.5") != plain
    assert cli.main([*base, "--out", str(tmp_path / "bad"), "--lora", f"{path}:strong"]) == 2
    assert "the strength 'strong' is not a number" in capsys.readouterr().err
