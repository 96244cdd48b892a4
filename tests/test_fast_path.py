"""The fast sampler path (``fast``): the blocks, whose quanto layers hold their int8/float8 weights as plain
tensors (as on every path), compiled. On the CPU: the same latents as the eager sampler, the layers
replaced with quanto's own values,
streaming (low-VRAM) composing with it, two compiled graphs for all blocks, clear errors, and the model
freed like any other. Speed and memory are the benchmark's (benchmarks/compute.py); the GPU tier
compiles with inductor."""

from __future__ import annotations

import gc

import pytest
import torch
from tolerances import assert_close

from pixart_lowvram.core import sampler, sampler_settings, transformer_run
from pixart_lowvram.core.quant.quanto import ScaledWeightLinear, plain_layers

SETTINGS = {"width": 64, "height": 64, "steps": 2, "cfg": 4.5, "seed": 3}
FP32 = {"device": "cpu", "precision": torch.float32}


@pytest.fixture
def no_compile(monkeypatch):
    """Blocks 'compiled' as they are (the tests that are about the expansion, not the compiler)."""
    compiled = []  # how many blocks each call got (not the blocks: they would outlive their model)

    def compile_blocks(blocks):
        compiled.append(len(blocks))

    monkeypatch.setattr(transformer_run, "compile_blocks", compile_blocks)
    return compiled


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


@pytest.mark.parametrize("quantization", ["qint8", "qfloat8"])
def test_expanded_blocks_give_the_quantized_latents(tiny, reference, quantization, no_compile):
    options = {**FP32, "quantization": quantization}
    quanto = sampler.sample(sampler_settings.SamplerSettings(tiny, **SETTINGS, **options), reference.embeds)
    fast = sampler.sample(
        sampler_settings.SamplerSettings(tiny, **SETTINGS, fast=True, **options), reference.embeds
    )
    # Exact: every path runs the plain layers, and no_compile leaves the blocks as they are: the same kernels.
    torch.testing.assert_close(fast, quanto, rtol=0, atol=0)
    assert no_compile == [tiny.config("transformer")["num_layers"]]


def test_unquantized_fast_path_only_compiles(tiny, reference, no_compile):
    plain = sampler.sample(
        sampler_settings.SamplerSettings(tiny, **SETTINGS, **FP32, quantization="none"), reference.embeds
    )
    fast = sampler.sample(
        sampler_settings.SamplerSettings(tiny, **SETTINGS, **FP32, quantization="none", fast=True),
        reference.embeds,
    )
    torch.testing.assert_close(fast, plain, rtol=0, atol=0)  # exact: the same model, not compiled here
    assert no_compile == [tiny.config("transformer")["num_layers"]]


@pytest.mark.parametrize("scheme", ["qint8", "qfloat8"])
def test_quantized_linears_become_plain_ones_holding_quantos_values(scheme):
    from optimum import quanto

    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.GELU(), torch.nn.Linear(16, 8, bias=False))
    quanto.quantize(model, weights=getattr(quanto, scheme))
    quanto.freeze(model)
    x = torch.randn(3, 32)
    expected = model(x)
    data = [model[0].weight._data, model[2].weight._data]
    assert plain_layers(model) == 2
    assert [type(m) for m in model] == [ScaledWeightLinear, torch.nn.GELU, ScaledWeightLinear]
    assert [model[0].weight, model[2].weight] == data  # quanto's own tensors, not copies
    assert all(type(t) is torch.Tensor for t in model.buffers())  # plain: they move and pin as any other
    assert model[0].weight.dtype == {"qint8": torch.int8, "qfloat8": torch.float8_e4m3fn}[scheme]
    assert model[2].bias is None
    # quanto's own formula in fp32 (its CPU int8 kernel serves bf16 only): the same numbers, to the rounding
    # of the bias quanto adds after the product and of another kernel's product (tests/tolerances.py)
    assert_close(model(x), expected)


def test_a_weight_without_per_row_scales_is_refused():
    from optimum import quanto

    model = torch.nn.Sequential(torch.nn.Linear(128, 16))
    quanto.quantize(model, weights=quanto.qint4)
    quanto.freeze(model)
    with pytest.raises(
        TypeError, match=r"0: a .* weight is not a per-row quantized one; the sampler takes qint8"
    ):
        plain_layers(model)


def test_fast_and_low_vram_together(tiny, reference, no_compile):
    options = {**FP32, "quantization": "qint8"}
    fast = sampler.sample(
        sampler_settings.SamplerSettings(tiny, **SETTINGS, fast=True, **options), reference.embeds
    )
    both = sampler.sample(
        sampler_settings.SamplerSettings(tiny, **SETTINGS, fast=True, low_vram=True, **options),
        reference.embeds,
    )
    # Exact: the int8 transformer fits the low-VRAM budget, so low_vram streams nothing here (the same
    # resident model and kernels; test_low_vram.py streams with the budget at 0).
    torch.testing.assert_close(both, fast, rtol=0, atol=0)


def test_fast_model_is_freed_after_its_stage(tiny, reference, load_spy, no_compile):
    sampler.sample(
        sampler_settings.SamplerSettings(tiny, **SETTINGS, **FP32, quantization="qint8", fast=True),
        reference.embeds,
    )
    gc.collect()
    assert load_spy.alive("transformer") == [False]


def test_fast_must_be_a_flag(tiny, reference):
    with pytest.raises(TypeError, match="fast must be true or false"):
        sampler.sample(
            sampler_settings.SamplerSettings(tiny, **SETTINGS, **FP32, fast="yes"), reference.embeds
        )


def test_compiled_blocks_give_the_eager_latents_and_a_reload_compiles_nothing(tiny, reference, graphs):
    options = {**FP32, "quantization": "qint8"}
    eager = sampler.sample(sampler_settings.SamplerSettings(tiny, **SETTINGS, **options), reference.embeds)
    compiled = sampler.sample(
        sampler_settings.SamplerSettings(tiny, **SETTINGS, fast=True, **options), reference.embeds
    )
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    traced = len(graphs)
    assert traced
    # The next prompt loads the transformer again (keep_loaded off): its blocks reuse the graphs, so
    # prompts never pile up compiles (torch.compile falls back to eager after 8 per function).
    again = sampler.sample(
        sampler_settings.SamplerSettings(tiny, **SETTINGS, fast=True, **options), reference.embeds
    )
    torch.testing.assert_close(again, compiled, rtol=0, atol=0)  # exact: the same graphs on the same data
    assert len(graphs) == traced


def test_all_blocks_share_their_graphs(tiny, graphs):
    """One graph however many blocks: the first block's input, which comes transposed from the patch
    embedding, is made row-major as the others' are (inductor laid out its 8-bit activations column-major,
    which torch._int_mm refuses on CUDA at some sizes). A second call of the same size traces nothing."""
    from diffusers import PixArtTransformer2DModel

    from pixart_lowvram.core.quant import TRANSFORMER_SCHEMES, choose

    config = dict(tiny.config("transformer"), num_layers=6)
    model = transformer_run.prepare(
        PixArtTransformer2DModel.from_config(config),
        choose("qint8", TRANSFORMER_SCHEMES, torch.device("cpu")),
        torch.device("cpu"),
        fast=True,
    )
    inputs = {
        "hidden_states": torch.randn(2, 4, 8, 8),
        "encoder_hidden_states": torch.randn(2, 5, config["caption_channels"]),
        "timestep": torch.tensor([500, 500]),
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
    }
    with torch.no_grad():
        first = model(**inputs).sample
        assert len(graphs) == 1
        torch.testing.assert_close(model(**inputs).sample, first, rtol=0, atol=0)
    assert len(graphs) == 1


def test_a_compiler_failure_names_the_fast_option(tiny, reference, monkeypatch):
    def broken(graph, example_inputs):
        raise RuntimeError("no C compiler")

    monkeypatch.setattr(transformer_run, "COMPILE_BACKEND", broken)
    torch._dynamo.reset()
    message = r"fast: torch.compile failed on this machine \(RuntimeError: no C compiler\)\. Turn the sampler's fast"
    with pytest.raises(RuntimeError, match=message):
        sampler.sample(
            sampler_settings.SamplerSettings(tiny, **SETTINGS, **FP32, quantization="qint8", fast=True),
            reference.embeds,
        )
    torch._dynamo.reset()


def test_autos_8bit_compile_failing_falls_back_to_fp16_in_one_line(tiny, reference, monkeypatch, caplog):
    """Where auto chose an 8-bit compute (an H100's fp8, here int8 on the CPU with its blocks compiled as on
    a GPU) and torch.compile fails, the prompt runs compute fp16 uncompiled, fp16's latents, with one log
    line, and auto takes fp16 for the rest of the process; an 8-bit compute asked for by name still stops
    with the error that names the option."""
    from pixart_lowvram.core.quant import compute

    def broken(graph, example_inputs):
        raise RuntimeError("no C compiler")

    monkeypatch.setattr(transformer_run, "COMPILE_BACKEND", broken)
    monkeypatch.setattr(compute, "_COMPILER_FAILED", [None])
    monkeypatch.setattr(
        compute, "resolve", lambda chosen, *args, eight_bit=False: "int8" if chosen == "auto" else chosen
    )
    # The blocks compile for an 8-bit compute, as on a GPU.
    compiled = property(lambda settings: settings.fast or settings.transformer.compute != "fp16")
    monkeypatch.setattr(sampler_settings.SamplerSettings, "compiled", compiled)
    torch._dynamo.reset()
    options = {**SETTINGS, **FP32, "quantization": "qint8"}
    try:
        with caplog.at_level("WARNING", logger=sampler.__name__):
            got = sampler.sample(sampler_settings.SamplerSettings(tiny, **options), reference.embeds)
        assert [r.getMessage() for r in caplog.records if r.name == sampler.__name__] == [
            "compute auto: torch.compile failed on this machine (RuntimeError: no C compiler); running "
            "compute fp16 instead"
        ]
        fp16 = sampler.sample(
            sampler_settings.SamplerSettings(tiny, **options, compute="fp16"), reference.embeds
        )
        torch.testing.assert_close(got, fp16, rtol=0, atol=0)
        assert not compute.compiler()
        with pytest.raises(transformer_run.CompileFailed, match=r"^fast: torch\.compile failed"):
            sampler.sample(
                sampler_settings.SamplerSettings(tiny, **options, compute="int8"), reference.embeds
            )
    finally:
        torch._dynamo.reset()
