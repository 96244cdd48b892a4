"""The fused 8-bit block (core.quant.block) on the tiny PixArt-Σ's first block: against the unfused 8-bit
block (diffusers' forward over the same 8-bit layers) and against the block computing with the same weights
and unquantized activations, for int8 and fp8, with a LoRA branch on one layer, and below MIN_ROWS rows.

bf16, the CPU's compute dtype: the unfused path rounds the norm and modulation to bf16 (2^-9 of a value)
before it quantizes, the fused one quantizes their float32 result, so the two quantize slightly different
rows. Each path is within its 8-bit error ``e`` of the unquantized block (``e`` measured here: int8 1.8 %,
fp8 3.4 % of the block's change to its input), so they are within 2e of each other (triangle inequality;
measured 0.90e and 0.85e); and the fused path, whose input to the quantization is the more precise, is no
further from the unquantized block than the unfused one, to 10 % of ``e`` (measured 0.98e and 0.99e). A
fused path with its feed-forward's output halved (a gate applied twice) is 17e and 9e off.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from diffusers.models.attention import BasicTransformerBlock
from tolerances import relative_error

from pixart_lowvram.core import sampler, sampler_settings, transformer_run
from pixart_lowvram.core.quant import block as fused_block
from pixart_lowvram.core.quant import compute, quanto
from pixart_lowvram.core.transformer import quantized_transformer

PATHS = ("int8", "fp8")
DTYPE = torch.bfloat16


@pytest.fixture(scope="module", params=PATHS)
def blocks(request, tiny):
    """The tiny transformer's first block as the sampler prepares it for an 8-bit compute, and a float32
    copy computing with the same 8-bit weights expanded (activations unquantized)."""
    path = request.param
    settings = sampler_settings.SamplerSettings(
        tiny, width=128, height=128, device="cpu", precision=DTYPE, quantization="qint8", compute=path
    )
    os.environ[fused_block.VARIABLE] = "1"  # on the CPU the sampler's prepare switches the blocks when asked
    try:
        model = transformer_run.prepare(
            quantized_transformer(settings.transformer), settings.scheme, torch.device("cpu"), compute=path
        )
    finally:
        del os.environ[fused_block.VARIABLE]
    block = model.transformer_blocks[0]
    unquantized = copy.deepcopy(block).float()
    fused_block.unuse_fused([unquantized])
    for layer in quanto.linear_layers(unquantized):
        layer.compute = compute.FP16
    return path, block, unquantized


def _inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, dict]:
    """A batch of 2: ``tokens`` image tokens, a 20-token caption whose second item has 5 padding tokens
    masked (the bias PixArt's transformer makes of the mask), and the time embedding's 6 rows."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens, 64, generator=generator)
    mask = torch.zeros(2, 1, 20)
    mask[1, :, 15:] = -10000.0
    kwargs = {
        "encoder_hidden_states": torch.randn(2, 20, 64, generator=generator),
        "encoder_attention_mask": mask,
        "timestep": torch.randn(2, 6 * 64, generator=generator) * 0.5,
    }
    return x.to(DTYPE), {key: value.to(DTYPE) for key, value in kwargs.items()}


def _changes(block, unquantized, x, kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the fused, the unfused and the unquantized block add to ``x`` (the residual taken out: it is
    the same in all three)."""
    fused = block(x, **kwargs) - x
    unfused = BasicTransformerBlock.forward(block, x, **kwargs) - x
    full = unquantized(x.float(), **{key: value.float() for key, value in kwargs.items()}) - x.float()
    return fused, unfused, full


def test_the_fused_block_is_the_unfused_8bit_block_within_its_8bit_error(blocks, fused_op_calls):
    path, block, unquantized = blocks
    assert block.forward.__func__ is fused_block.fused_forward  # the sampler's prepare switched it
    x, kwargs = _inputs(tokens=64)
    fused, unfused, full = _changes(block, unquantized, x, kwargs)
    # q/k/v and ff1 from the norm + modulation, ff2 from the GELU, both output projections and the
    # cross-attention's query from a plain quantization.
    assert fused_op_calls == {"norm_modulate_quantize": 2, "gelu_quantize": 1, "quantize_rows": 3}
    error = relative_error(unfused, full)
    assert 0 < error < {"int8": 0.04, "fp8": 0.1}[path], error
    assert 0 < relative_error(fused, unfused) <= 2 * error
    assert relative_error(fused, full) <= 1.1 * error


def test_the_bound_catches_a_fused_block_without_its_gate(blocks, monkeypatch):
    _path, block, unquantized = blocks
    x, kwargs = _inputs(tokens=64)
    _fused, unfused, full = _changes(block, unquantized, x, kwargs)
    feed_forward = fused_block._feed_forward
    monkeypatch.setattr(fused_block, "_feed_forward", lambda *args: feed_forward(*args) / 2)
    halved = block(x, **kwargs) - x
    assert relative_error(halved, unfused) > 2 * relative_error(unfused, full)


def test_a_lora_stays_on_the_fused_path(blocks, fused_op_calls):
    """A LoRA on ``to_k``: every input stays fused, the layer's product taking q, k and v's quantized input
    on its patched weight quantized again; the LoRA moves the output as it moves the unfused block's and the
    unquantized one's (its LoRA folded into the weight)."""
    _path, block, unquantized = blocks
    x, kwargs = _inputs(tokens=64)
    generator = torch.Generator().manual_seed(3)
    up, down = torch.randn(64, 4, generator=generator), torch.randn(4, 64, generator=generator)
    key = block.attn1.to_k
    without = block(x, **kwargs)
    fused_op_calls.clear()
    lora_ = compute.LowRank(up, down, 0.5)
    dtype = key.weight_scale.dtype  # the factors in the dtype the layer expands its weight to
    key.weight_patch = compute.LowRank(up.to(dtype), down.to(dtype), 0.5).fold_into
    reference = unquantized.attn1.to_k
    reference.weight_patch = lora_.fold_into  # the unquantized block: the LoRA in its weight
    try:
        fused, unfused, full = _changes(block, unquantized, x, kwargs)
    finally:
        quanto.clear_run_patches(key), quanto.clear_run_patches(reference)
    assert fused_op_calls == {"norm_modulate_quantize": 2, "gelu_quantize": 1, "quantize_rows": 3}
    error = relative_error(unfused, full)
    assert relative_error(fused, unfused) <= 2 * error
    assert relative_error(fused, full) <= 1.1 * error
    assert relative_error(fused + x, without) > error  # the LoRA is there


def test_few_rows_take_diffusers_forward_bit_for_bit(blocks, fused_op_calls):
    """16 tokens of a batch of 2: 32 rows, MIN_ROWS, so every layer takes its fp16 path."""
    _path, block, _unquantized = blocks
    x, kwargs = _inputs(tokens=compute.MIN_ROWS // 2)
    assert torch.equal(block(x, **kwargs), BasicTransformerBlock.forward(block, x, **kwargs))
    assert fused_op_calls == {}


def test_use_fused_switches_pixart_blocks_only_and_unuse_fused_switches_back():
    from diffusers.models.attention import BasicTransformerBlock as Block

    pixart = Block(64, 2, 32, cross_attention_dim=64, activation_fn="gelu-approximate", norm_type="ada_norm_single",
                   norm_elementwise_affine=False, norm_eps=1e-6)  # fmt: skip
    assert fused_block.use_fused([pixart], "fp16") == 0 and "forward" not in vars(pixart)
    assert fused_block.use_fused([pixart], "int8") == 1
    assert pixart.forward.__func__ is fused_block.fused_forward
    fused_block.unuse_fused([pixart])
    assert "forward" not in vars(pixart)
    plain = Block(64, 2, 32, cross_attention_dim=64)
    with pytest.raises(
        TypeError, match=r"^block 1 is a BasicTransformerBlock without ada_norm_single modulation"
    ):
        fused_block.use_fused([pixart, plain], "fp8")
    assert "forward" not in vars(pixart)  # nothing switched


def test_the_sampler_fuses_where_the_kernels_run_or_as_told_and_a_bad_setting_is_one_line(tiny, monkeypatch):
    settings = sampler_settings.SamplerSettings(
        tiny, width=128, height=128, device="cpu", precision=DTYPE, quantization="qint8", compute="int8"
    )

    def first_block(compute: str):
        quantized = quantized_transformer(settings.transformer)
        model = transformer_run.prepare(
            quantized, settings.scheme, torch.device("cpu"), compute=compute, quantized=True
        )
        return model.transformer_blocks[0]

    monkeypatch.delenv(fused_block.VARIABLE, raising=False)
    assert "forward" not in vars(first_block("int8"))  # unset on the CPU: diffusers' forward
    # Unset, fused where the kernels run: CUDA with Triton (a device is not needed to ask).
    assert fused_block.wanted("cuda") == (fused_block.fused_kernels.triton is not None)
    assert not fused_block.wanted("cpu")
    monkeypatch.setenv(fused_block.VARIABLE, "0")
    assert not fused_block.wanted("cuda")
    monkeypatch.setenv(fused_block.VARIABLE, "1")
    assert vars(first_block("int8"))["forward"].__func__ is fused_block.fused_forward
    assert "forward" not in vars(first_block("fp16"))  # fp16 compute: diffusers' forward
    monkeypatch.setenv(fused_block.VARIABLE, "yes")
    with pytest.raises(ValueError, match=r"^PIXART_LOWVRAM_FUSED_QUANT='yes' is not a setting; set it to 1"):
        fused_block.wanted("cpu")


def test_a_compiled_run_after_one_with_a_lora_gives_the_first_runs_latents(
    tiny, tiny_folder, reference, tmp_path, monkeypatch
):
    """Compiled blocks keep one graph a size whatever LoRAs ran before: a LoRA's branches are taken off to
    the layers' class defaults, and the fused block asks for them without a graph break (dynamo cannot
    trace ``not`` on a tuple); otherwise a later run picks the LoRA run's graph-broken entry, which rounds
    differently. The same computation twice: bit for bit."""
    import dataclasses

    from pixart_lowvram.cli.random_model import save_random_lora
    from pixart_lowvram.core import lora

    settings = sampler_settings.SamplerSettings(
        tiny, width=128, height=128, steps=2, seed=7, device="cpu", quantization="qint8", compute="int8",
        fast=True,
    )  # fmt: skip
    monkeypatch.setenv(fused_block.VARIABLE, "1")
    first = sampler.sample(settings, reference.embeds)
    path = save_random_lora(tiny_folder, tmp_path / "lora.safetensors", scale=0.15)
    sampler.sample(dataclasses.replace(settings, loras=(lora.LoraSpec(path),)), reference.embeds)
    assert torch.equal(sampler.sample(settings, reference.embeds), first)
