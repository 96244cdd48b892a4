"""The sampler's quantized layers as plain torch layers (core/quant/quanto.py): quanto's own numbers, the
weights held expanded for a run where the device has the room (``dense``), the placement low_vram picks,
and the stage's garbage collection only when a model was let go. On the CPU; the GPU tier checks the
same layers against quanto's CUDA kernels bit for bit (tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close

from pixart_lowvram.core import estimates, measure, sampler, sampler_settings, transformer_run
from pixart_lowvram.core.estimates import Workload
from pixart_lowvram.core.quant import TRANSFORMER_SCHEMES
from pixart_lowvram.core.quant.quanto import ScaledWeightLinear, dense_bytes, dense_weights, plain_layers

SETTINGS = {"width": 64, "height": 64, "steps": 2, "cfg": 4.5, "seed": 3}
MEGAPIXEL = 1024 * 1024


def _quantized(scheme: str, dtype: torch.dtype) -> torch.nn.Sequential:
    from optimum import quanto

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 16, bias=False))
    model = model.to(dtype)
    quanto.quantize(model, weights=getattr(quanto, scheme))
    quanto.freeze(model)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scheme", ["qint8", "qfloat8"])
def test_plain_and_dense_layers_compute_quantos_numbers(scheme, dtype):
    """quanto's expansion (scale × data) and one product with the bias fused: a layer without bias gives
    quanto's own numbers wherever quanto uses that expansion itself (here fp32 and fp16 on the CPU; on
    CUDA for every dtype; bit for bit here, bounded as one operation run by another kernel,
    tests/tolerances.py), one with bias the same to the rounding of the sum; dense and per-call expansion
    agree bit for bit (the same expansion and product on the same values)."""
    model = _quantized(scheme, dtype)
    x = torch.randn(2, 3, 64, dtype=dtype)
    by_quanto, first_by_quanto = model(x), model[0](x)
    assert plain_layers(model) == 2
    plain = model(x)
    assert_close(model[2](model[1](first_by_quanto)), by_quanto)  # the bias-less layer
    tolerance = {torch.float32: 1e-6, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(model[0](x), first_by_quanto, rtol=tolerance, atol=tolerance)
    with dense_weights(model) as layers:
        assert layers == 2
        assert [m.weight_dense.dtype for m in model if isinstance(m, ScaledWeightLinear)] == [dtype] * 2
        assert torch.equal(model(x), plain)
    assert all(m.weight_dense is None for m in model if isinstance(m, ScaledWeightLinear))


def test_dense_weights_are_dropped_when_the_run_fails():
    model = _quantized("qint8", torch.float32)
    plain_layers(model)
    assert dense_bytes(model) == (32 * 64 + 16 * 32) * 4
    with pytest.raises(RuntimeError, match="cancelled"), dense_weights(model):
        raise RuntimeError("cancelled")
    assert all(m.weight_dense is None for m in model if isinstance(m, ScaledWeightLinear))
    # never saved: the expanded weight is the run's, not the model's
    assert not any("dense" in name for name in model.state_dict())


def test_the_sampler_runs_plain_layers(tiny, reference, load_spy, host_pool):
    options = {"device": "cpu", "precision": torch.float32}
    sampler.sample(sampler_settings.SamplerSettings(tiny, **SETTINGS, **options), reference.embeds)
    model = load_spy.last("transformer")()  # alive: waiting in the host-memory pool
    kinds = {type(m).__name__ for m in model.modules()}
    assert "ScaledWeightLinear" in kinds and "QLinear" not in kinds


def test_which_runs_hold_dense_weights(tiny):
    """Dense runs need a GPU (settings for one cannot be made without CUDA: the GPU tier runs them); on the
    CPU a run expands per layer and asks for no more room, and the dense estimate adds the fp16 copy, still
    under T5's peak."""
    on_cpu = sampler_settings.SamplerSettings(tiny, device="cpu")
    assert not on_cpu.dense
    qint8 = TRANSFORMER_SCHEMES["qint8"]
    weights, work = on_cpu.device_bytes(Workload(1, MEGAPIXEL))
    assert (weights, work) == estimates.transformer(qint8, on_cpu.dtype, 1, MEGAPIXEL)
    dense = estimates.transformer(qint8, torch.float16, 1, MEGAPIXEL, dense=True)
    assert dense[1] - work == estimates.TRANSFORMER_PARAMETERS * 2  # the fp16 copy, during the run
    assert sum(dense) < 2.75 * estimates.GIB  # under T5's peak: the image's peak is unchanged


def test_an_8bit_run_holds_weights_only_for_a_lora(tiny, tiny_folder, tmp_path, monkeypatch):
    """Where a run may hold weights (a GPU: stood in for here), an 8-bit compute holds its LoRA's patched
    weights, and nothing without a LoRA (one of strength 0 is left out): its fp16 layers outside the blocks
    stay expanded per call, as the measured 8-bit sampler runs; the stage's estimate adds no fp16 copy."""
    from pixart_lowvram.cli.random_model import save_random_lora
    from pixart_lowvram.core import lora, transformer

    monkeypatch.setattr(transformer.TransformerSettings, "dense", property(lambda self: True))
    path = save_random_lora(tiny_folder, tmp_path / "lora.safetensors")
    options = {"device": "cpu", "quantization": "qint8", "compute": "int8"}
    without = sampler_settings.SamplerSettings(tiny, **options)
    off = sampler_settings.SamplerSettings(tiny, **options, loras=(lora.LoraSpec(path, 0.0),))
    on = sampler_settings.SamplerSettings(tiny, **options, loras=(lora.LoraSpec(path, 1.0),))
    assert (without.dense, off.dense, on.dense) == (False, False, True)
    assert not sampler_settings.SamplerSettings(tiny, **options, low_vram=True, loras=on.loras).dense
    assert sampler_settings.SamplerSettings(tiny, device="cpu", compute="fp16").dense
    work = Workload(1, MEGAPIXEL)
    assert on.device_bytes(work) == estimates.transformer(on.scheme, on.dtype, 1, MEGAPIXEL)


@pytest.mark.parametrize("pool", ["on", "off"])
def test_a_stage_collects_garbage_only_when_its_model_was_let_go(tiny, reference, monkeypatch, pool, request):
    """Collecting takes a tenth of a second or more in a large process: a stage whose model waits in the
    host-memory pool skips it; one whose model was loaded or dropped collects."""
    if pool == "on":
        request.getfixturevalue("host_pool")
    collected = []
    monkeypatch.setattr(measure.gc, "collect", lambda *args: collected.append(1) or 0)
    settings = sampler_settings.SamplerSettings(tiny, **SETTINGS, device="cpu", precision=torch.float32)
    sampler.sample(settings, reference.embeds)
    assert collected, "a fresh load collects what loading left behind"
    collected.clear()
    sampler.sample(settings, reference.embeds)
    assert bool(collected) == (pool == "off"), "pooled: nothing to collect; dropped: collected"


@pytest.mark.parametrize(("room", "dense"), [(10**12, True), ("run", True), ("short", False)])
def test_a_run_holds_dense_weights_when_they_and_the_run_fit(tiny, monkeypatch, room, dense):
    """The room asked for is the expanded weights plus the run's own work, once (the stage's estimate, which
    ComfyUI is asked for, counts the copy in already); short of it, the layers expand per call."""
    monkeypatch.setattr(sampler_settings.SamplerSettings, "dense", property(lambda self: True))
    settings = sampler_settings.SamplerSettings(tiny, device="cpu")
    model = _quantized("qint8", torch.float32)
    plain_layers(model)
    run = estimates.transformer(settings.scheme, settings.dtype, 1, MEGAPIXEL)[1]
    exact = dense_bytes(model) + run
    free = {"run": exact, "short": exact - 1}.get(room, room)
    monkeypatch.setattr(measure, "device_room", lambda device: free)
    with transformer_run._dense(settings, model, Workload(1, MEGAPIXEL)):
        held = [m.weight_dense is not None for m in model if isinstance(m, ScaledWeightLinear)]
    assert held == [dense, dense]
    assert all(m.weight_dense is None for m in model if isinstance(m, ScaledWeightLinear))
