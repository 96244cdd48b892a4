"""The transformer's 8-bit compute paths (core.quant.compute): their arithmetic against an fp64 reference of
the same stored weights, within bounds worked out from the formats; the sampler's ``compute`` input, its
choices and its errors; LoRAs in the 8-bit weights, quantized again; and the whole tiny model's
latents against the fp16 path's.

The bounds. A per-token symmetric int8 activation rounds each value to a step of absmax / 127: a uniform
error of rms step / √12. For Gaussian rows of 1152 values absmax is about 3.3 σ, so the relative rms error of
the activation, and of a product with it, is about 3.3 / 127 / √12 ≈ 0.75 % (measured 0.79 %); the bound is
twice that. float8 e4m3 keeps 3 mantissa bits: a relative rounding of at most 2^-4 of a value, rms about
2^-4 / √3 · ½ ≈ 1.8 % for each operand (weight and activation), about 2.6 % together in quadrature, and the
int8 weight's own rounding into e4m3 adds to it (measured 3.8 %); the bound is 6 %. A path that dropped a
scale, quantized without one, or multiplied by the wrong one is off by far more than that.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pixart_lowvram.cli import commands
from pixart_lowvram.cli.random_model import save_random_lora
from pixart_lowvram.core import estimates, lora, sampler, sampler_settings, transformer, transformer_run
from pixart_lowvram.core.quant import compute, quanto
from pixart_lowvram.core.transformer import quantized_transformer

REPO = Path(__file__).resolve().parents[1]
FP32 = {"device": "cpu", "precision": torch.float32}
SETTINGS = {"width": 64, "height": 64, "steps": 2, "cfg": 4.5, "seed": 5}
BOUND = {"int8": 0.015, "fp8": 0.06}


def _quantized_weight(out: int, width: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, width, generator=generator) * 0.02
    scale = weight.abs().amax(1, keepdim=True) / 127
    return (weight / scale).round().clamp(-127, 127).to(torch.int8), scale


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected).norm() / expected.norm())


@pytest.fixture(autouse=True)
def _never_compiled(monkeypatch):
    """On the CPU the 8-bit paths run eager (the GPU tier compiles them with inductor)."""

    def compile_blocks(blocks):
        raise AssertionError("an 8-bit path compiled its blocks on the CPU")

    monkeypatch.setattr(transformer_run, "compile_blocks", compile_blocks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["int8", "fp8"])
def test_an_8bit_linear_is_within_its_bound_of_the_stored_weights_product(path, dtype):
    data, scale = _quantized_weight(512, 1152)
    bias = torch.randn(512) * 0.1
    x = torch.randn(2, 96, 1152, generator=torch.Generator().manual_seed(1))
    expected = x.double() @ (data.double() * scale.double()).t() + bias.double()
    got = compute.linear(path, x.to(dtype), compute.weight_for(path, data), scale.to(dtype), bias.to(dtype))
    assert got.dtype == dtype and got.shape == expected.shape
    error = _relative(got, expected)
    assert error < BOUND[path], f"{path} {dtype}: relative error {error:.4f}"
    # Not a product that ignores the activation's scale: a quantization without one is far off.
    assert error > 1e-4


def test_the_bound_catches_a_missing_scale():
    data, scale = _quantized_weight(256, 1152)
    x = torch.randn(64, 1152)
    expected = x.double() @ (data.double() * scale.double()).t()
    wrong = compute.linear("int8", x, data, torch.ones_like(scale), None)
    assert _relative(wrong, expected) > 1


def test_an_int8_weight_in_e4m3_keeps_small_integers_and_its_scale():
    values = torch.arange(-127, 128, dtype=torch.int8)
    e4m3 = compute.weight_for("fp8", values)
    assert e4m3.dtype == torch.float8_e4m3fn
    back = e4m3.float()
    small = values.abs() <= 16
    assert torch.equal(back[small], values[small].float())
    assert float(((back - values.float()).abs() / values.float().abs().clamp(min=1)).max()) <= 1 / 16
    assert compute.weight_for("int8", values) is values


@pytest.mark.parametrize("path", ["int8", "fp8"])
def test_a_layer_computes_by_its_path_and_few_rows_take_the_fp16_one(path):
    data, scale = _quantized_weight(256, 1152)
    layer = quanto.ScaledWeightLinear(data.clone(), scale, None)
    plain = quanto.ScaledWeightLinear(data.clone(), scale, None)
    assert quanto.set_compute(layer, path) == 1
    assert layer.weight.dtype == (torch.int8 if path == "int8" else torch.float8_e4m3fn)
    many = torch.randn(compute.MIN_ROWS + 1, 1152)
    torch.testing.assert_close(
        layer(many), compute.linear(path, many, layer.weight, scale, None), rtol=0, atol=0
    )
    few = torch.randn(compute.MIN_ROWS, 1152)
    if path == "int8":  # its values are the stored ones: the fp16 path gives the plain layer's bits
        torch.testing.assert_close(layer(few), plain(few), rtol=0, atol=0)
    assert quanto.dense_layers(layer) == []  # an 8-bit layer never holds its weight expanded


def _loras(strength: float = 0.5) -> list[compute.LowRank]:
    """Two LoRAs of a 96-row, 128-wide layer: rank 4 on rows 32:64, rank 3 on rows 64:96, their change about
    the weights' own size (:func:`_quantized_weight`)."""
    generator = torch.Generator().manual_seed(2)
    return [
        compute.LowRank(torch.randn(32, rank, generator=generator) * 0.1,
                        torch.randn(rank, 128, generator=generator) * 0.1, strength, rows)
        for rank, rows in ((4, (32, 32)), (3, (64, 32)))
    ]  # fmt: skip


class _Patch:
    """LoRAs as a layer's ``weight_patch`` (the MODEL's ``_Fold``)."""

    def __init__(self, loras: list[compute.LowRank]):
        self.loras = loras

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        for lora_ in self.loras:
            lora_.fold_into(weight)
        return weight


def _patched_weight(data: torch.Tensor, scale: torch.Tensor, loras: list[compute.LowRank]) -> torch.Tensor:
    """The stored weight plus the LoRAs, in float64."""
    weight = data.double() * scale.double()
    for lora_ in loras:
        start, size = lora_.rows
        weight[start : start + size] += lora_.scale * lora_.up.double() @ lora_.down.double()
    return weight


@pytest.mark.parametrize("path", ["int8", "fp8"])
def test_a_patched_8bit_layer_computes_with_its_patched_weight_quantized_again(path):
    """Two LoRAs on an 8-bit layer: the layer quantizes its patched weight again per row to its 8 bits and
    makes the same 8-bit product on it — within the 8-bit bound of the patched weight's product in float64,
    and of the LoRAs' own change — whether it quantizes its input or is handed it quantized (the fused
    blocks). Held for a run (hold_dense), the same bits as made at each call, in 1 byte a weight and a
    float32 scale a row; a call of few rows (the fp16 path) computes with the held values expanded. Dropped,
    the layer is as before."""
    data, scale = _quantized_weight(96, 128)
    layer = quanto.ScaledWeightLinear(data, scale, None)
    quanto.set_compute(layer, path)
    x = torch.randn(compute.MIN_ROWS * 2, 128, generator=torch.Generator().manual_seed(1))
    base = layer(x)
    loras = _loras()
    weight = _patched_weight(data, scale, loras)
    layer.weight_patch = _Patch(loras)
    assert quanto.patched_layers(layer) == [layer] and quanto.dense_layers(layer) == []
    values, scales = layer.requantized()
    assert values.dtype == layer.weight.dtype and scales.shape == (96, 1) and scales.dtype == torch.float32
    assert _relative(values.double() * scales.double(), weight) < BOUND[path]
    got = layer(x)
    assert _relative(got, x.double() @ weight.t()) < BOUND[path]
    change = x.double() @ (weight - data.double() * scale.double()).t()
    assert _relative(got - base, change) < 2 * BOUND[path]
    rows = compute.quantize_rows(x, path)
    assert torch.equal(layer.product(rows, x.dtype), got)
    few = x[: compute.MIN_ROWS]
    per_call_few = layer(few)
    assert quanto.dense_bytes(layer) == 96 * (128 + 4)
    with quanto.dense_weights(layer) as held:
        assert held == 1 and layer.patched_weight.dtype == layer.weight.dtype
        torch.testing.assert_close(layer(x), got, rtol=0, atol=0)
        expanded = layer.patched_weight.float() * layer.patched_scale
        torch.testing.assert_close(layer(few), few @ expanded.t(), rtol=1e-5, atol=1e-6)
        assert _relative(layer(few), few.double() @ weight.t()) < BOUND[path]
    assert all(name not in vars(layer) for name in quanto.PATCHED)
    torch.testing.assert_close(per_call_few, layer(few), rtol=0, atol=0)
    quanto.clear_run_patches(layer)
    torch.testing.assert_close(layer(x), base, rtol=0, atol=0)
    assert quanto.dense_bytes(layer) == 0


def test_every_strength_runs_one_compiled_graph_on_held_weights(graphs):
    """Dynamo reads a float attribute as a constant (with static shapes, the sampler's blocks compiled again
    for each strength, and past eight ran eager). A run holds each 8-bit layer's patched weight, which a
    compiled layer takes as an input and never reads the patch: every strength is one graph, and computes
    what the eager layer does."""
    data, scale = _quantized_weight(96, 128)
    layer = quanto.ScaledWeightLinear(data, scale, None)
    quanto.set_compute(layer, "int8")
    x = torch.randn(compute.MIN_ROWS * 2, 128)
    run = torch.compile(layer.forward, backend=graphs, dynamic=False)
    for strength in (0.5, 0.25, 1.5):
        layer.weight_patch = _Patch(_loras(strength))
        with quanto.dense_weights(layer):
            torch.testing.assert_close(run(x), layer(x), rtol=0, atol=0)
        quanto.clear_run_patches(layer)
    assert len(graphs) == 1


def test_a_low_rank_fold_adds_its_lora_to_the_weights_rows():
    """Folded into an expanded weight (the MODEL's LoRA on a layer computing in fp16): the weight plus
    ``scale × up @ down`` on its rows, in one multiply-add; a convolution's weight taken as its rows."""
    weight, up, down = torch.randn(96, 40), torch.randn(32, 4), torch.randn(4, 40)
    folded = compute.LowRank(up, down, 0.5, rows=(32, 32)).fold_into(weight.clone())
    expected = weight.clone()
    expected[32:64] = expected[32:64] + 0.5 * (up @ down)
    torch.testing.assert_close(folded, expected, rtol=1e-6, atol=1e-6)
    kernel, up, down = torch.randn(8, 3, 2, 2), torch.randn(8, 4), torch.randn(4, 12)
    folded = compute.LowRank(up, down, -1.5).fold_into(kernel.clone())
    torch.testing.assert_close(folded, kernel - 1.5 * (up @ down).view(8, 3, 2, 2), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"compute": "int4"}, r"compute 'int4' is not offered; choose one of auto, fp16, int8, fp8\."),
        (
            {"compute": "int8", "quantization": "qfloat8"},
            r"compute 'int8' runs on qint8 weights, and quantization is 'qfloat8'; set quantization to qint8",
        ),
        (
            {"compute": "fp8", "quantization": "none"},
            r"compute 'fp8' runs on quantized weights, and quantization is 'none'; set quantization to qint8",
        ),
    ],
)
def test_a_bad_compute_is_refused_before_anything_loads(tiny, load_spy, options, message):
    with pytest.raises(ValueError, match=message):
        sampler_settings.SamplerSettings(tiny, **SETTINGS, **FP32, **options)
    assert load_spy.count("transformer") == 0


def _card(monkeypatch, capability: tuple[int, int], name: str, hip: str | None = None) -> None:
    """Fake the device facts the choice of compute reads: CUDA capability, card name, and ROCm's version."""
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_a_card_without_the_tensor_cores_gets_one_line_naming_it_and_the_option(monkeypatch):
    cuda = torch.device("cuda")
    _card(monkeypatch, (8, 6), "NVIDIA GeForce RTX 3090")
    with pytest.raises(RuntimeError) as error:
        compute.require("fp8", cuda, "qint8")
    assert str(error.value) == (
        "compute 'fp8' needs an NVIDIA GPU of compute capability 8.9 or newer (RTX 40 and later, L4, L40, H100, "
        "H200); NVIDIA GeForce RTX 3090 is 8.6. Set compute to int8."
    )
    compute.require("int8", cuda, "qint8")  # Ampere has int8 tensor cores
    _card(monkeypatch, (7, 0), "Tesla V100-SXM2-16GB")
    for name in ("int8", "fp8"):
        with pytest.raises(RuntimeError, match=r"Tesla V100-SXM2-16GB is 7\.0\. Set compute to fp16\.$"):
            compute.require(name, cuda, "qint8")
    # ROCm: an MI200 reports capability 9.0, and has neither path's NVIDIA tensor cores.
    _card(monkeypatch, (9, 0), "AMD Instinct MI250X", hip="6.2.41133")
    for name in ("int8", "fp8"):
        with pytest.raises(RuntimeError) as error:
            compute.require(name, cuda, "qint8")
        assert str(error.value) == (
            f"compute {name!r} needs {compute.TABLE[name].needs()}; AMD Instinct MI250X is an AMD GPU (ROCm). "
            "Set compute to fp16."
        )
    with pytest.raises(RuntimeError, match=r"^compute 'fp8' runs on NVIDIA GPUs and the CPU, not on 'mps'"):
        compute.require("fp8", torch.device("mps"), "qint8")


def test_auto_is_fp8_on_hopper_and_fp16_elsewhere(tiny, monkeypatch, caplog):
    """``auto`` (the default) takes the measured faster path where its caller lets it (``eight_bit``: the
    sampler without low_vram): fp8 on an NVIDIA card of compute capability 9.0 with quantized weights;
    fp16 where it may not, on other cards, unquantized, on the CPU, on ROCm, without Triton, and wherever
    the table's compute cannot run. A value set is kept as it is."""
    cuda = torch.device("cuda")
    _card(monkeypatch, (9, 0), "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(compute, "compiler", lambda: True)
    with caplog.at_level("INFO", logger=compute.__name__):
        assert compute.resolve("auto", cuda, "qint8", eight_bit=True) == "fp8"
        monkeypatch.setattr(compute, "compiler", lambda: False)  # no Triton: the blocks cannot compile
        assert compute.resolve("auto", cuda, "qint8", eight_bit=True) == "fp16"
        assert compute.resolve("fp8", cuda, "qint8") == "fp8"  # asked for: its compile's error says so
        monkeypatch.setattr(compute, "compiler", lambda: True)
    assert caplog.messages == [
        "compute auto: fp8 on NVIDIA H100 80GB HBM3 (set compute to fp16 for fp16's products)",
        "compute auto: fp16 on NVIDIA H100 80GB HBM3: no Triton, which fp8's compiled blocks need",
    ]
    assert compute.resolve("auto", cuda, "qfloat8", eight_bit=True) == "fp8"
    assert compute.resolve("auto", cuda, "qint8", eight_bit=False) == "fp16"
    assert compute.resolve("auto", cuda, "none", eight_bit=True) == "fp16"
    assert compute.resolve("auto", torch.device("cpu"), "qint8", eight_bit=True) == "fp16"
    assert compute.resolve("auto", torch.device("mps"), "qint8", eight_bit=True) == "fp16"
    for kept in ("fp16", "int8", "fp8"):
        assert compute.resolve(kept, cuda, "qint8") == kept
    _card(monkeypatch, (8, 9), "NVIDIA L4")  # unmeasured
    assert compute.resolve("auto", cuda, "qint8", eight_bit=True) == "fp16"
    _card(monkeypatch, (9, 0), "AMD Instinct MI250X", hip="6.2.41133")
    assert compute.resolve("auto", cuda, "qint8", eight_bit=True) == "fp16"
    # A row naming a card below its own capability: auto still takes only what the card runs.
    monkeypatch.setitem(compute.TABLE, "fp8", dataclasses.replace(compute.TABLE["fp8"], fastest=(8, 6)))
    _card(monkeypatch, (8, 6), "NVIDIA GeForce RTX 3090")
    assert compute.resolve("auto", cuda, "qint8", eight_bit=True) == "fp16"


def test_auto_is_decided_once_by_the_transformers_settings(tiny, tiny_folder, tmp_path, monkeypatch):
    """The sampler's settings keep ``compute`` as given and run what its transformer's settings decided,
    asking once: 8-bit allowed without low_vram, with or without a LoRA (``fast`` plays no part); the int8
    Model Loader asks for it itself."""
    settings = sampler_settings.SamplerSettings(tiny, **SETTINGS, **FP32, fast=True)  # the CPU: fp16
    assert (settings.compute, settings.transformer.compute) == ("auto", "fp16")
    asked = []
    monkeypatch.setattr(compute, "resolve", lambda *args, eight_bit: asked.append(eight_bit) or "fp8")
    chosen = sampler_settings.SamplerSettings(tiny, **SETTINGS, **FP32, quantization="qint8")
    sampler_settings.SamplerSettings(tiny, **SETTINGS, **FP32, fast=True, low_vram=True)
    sampler_settings.SamplerSettings(tiny, **SETTINGS, **FP32, fast=True)
    path = save_random_lora(tiny_folder, tmp_path / "lora.safetensors")
    for strength in (0.8, 0.0):
        sampler_settings.SamplerSettings(tiny, **SETTINGS, **FP32, loras=(lora.LoraSpec(path, strength),))
    transformer.TransformerSettings(tiny, quantization="qint8", device="cpu")  # by default
    assert asked == [True, False, True, True, True, False]
    assert chosen.compute == "auto" and chosen.transformer.compute == "fp8"
    assert "fp8" in chosen.cache_key(estimates.Workload.of(torch.zeros(1, 4, 32, 32)))
    assert chosen.compiled is False  # fp8 on the CPU runs eager


def test_auto_takes_a_compute_only_where_the_table_says_it_runs():
    for cards in compute.TABLE.values():
        assert cards.fastest is None or cards.fastest >= cards.capability


def _words(text: str) -> str:
    return " ".join(text.split())


def test_readme_usage_tooltips_and_help_name_the_tables_cards():
    """Which card gets which compute, as README, docs/USAGE.md, the nodes' tooltips and ``--help`` say it,
    is :data:`compute.TABLE`'s; and each card in USAGE's table of what to pick runs the 8-bit computes its
    row names."""
    readme, usage = (
        _words((REPO / name).read_text(encoding="utf-8")) for name in ("README.md", "docs/USAGE.md")
    )
    sub = commands.build_parser()._subparsers._group_actions[0].choices["generate"]
    (option,) = [action for action in sub._actions if "--compute" in action.option_strings]
    said = [
        sampler_settings.INPUTS["compute"].tooltip,
        transformer.LOADER_INPUTS["compute"].tooltip,
        option.help,
    ]
    for name, cards in compute.TABLE.items():
        for doc in (readme, usage):
            assert f"`{name}` ({cards.names})" in doc, name
        for text in said:
            assert f"{name} tensor-core products ({cards.names})" in text, name
        if cards.fastest:
            for doc in (readme, usage):
                assert f"`{name}` on {cards.fastest_names}" in doc, name
            for text in said:
                assert f"auto: {name} on {cards.fastest_names} (in the sampler not with low_vram)" in text, (
                    name
                )
            major, minor = cards.fastest
            assert f"| {cards.fastest_names} ({major}.{minor}) | `{name}`" in usage, name
    raw = (REPO / "docs/USAGE.md").read_text(encoding="utf-8")
    picks = raw.split("What to pick on which card:\n\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    assert picks
    for row in picks:
        card, speed, memory = row.strip("|").split(" | ")[:3]
        capabilities = [tuple(map(int, c.split("."))) for c in re.findall(r"\d+\.\d+", card)]
        for name, cards in compute.TABLE.items():
            if f"`{name}`" in speed + memory:
                assert capabilities and min(capabilities) >= cards.capability, row


def test_the_path_is_in_the_cache_key(tiny):
    fp16 = sampler_settings.SamplerSettings(tiny, **SETTINGS, **FP32)
    int8 = sampler_settings.SamplerSettings(tiny, **SETTINGS, **FP32, compute="int8")
    assert (fp16.transformer.compute, int8.transformer.compute) == ("fp16", "int8")
    assert not int8.compiled and not fp16.compiled  # eager on the CPU
    assert dataclasses.replace(int8, fast=True).compiled
    work = estimates.Workload(1, 64 * 64)
    assert fp16.cache_key(work) != int8.cache_key(work)


@pytest.fixture(scope="module")
def fp16_latents(tiny_folder, tiny):
    from pixart_lowvram.core import text_encoder

    embeds = text_encoder.encode(text_encoder.EncoderSettings(tiny, **FP32), "a red cat on a mat", "")
    settings = sampler_settings.SamplerSettings(tiny, **SETTINGS, **FP32, quantization="qint8")
    return embeds, sampler.sample(settings, embeds)


# The tiny model's latents after 2 steps, 8-bit against fp16 compute (fp32 on the CPU): measured int8
# 0.9999+, fp8 0.998+.
LATENT_COSINE = {"int8": 0.999, "fp8": 0.99}


@pytest.mark.parametrize("path", ["int8", "fp8"])
def test_the_sampler_on_an_8bit_path_is_close_to_fp16_and_repeats_its_bits(tiny, fp16_latents, path):
    embeds, reference = fp16_latents
    settings = sampler_settings.SamplerSettings(tiny, **SETTINGS, **FP32, quantization="qint8", compute=path)
    first = sampler.sample(settings, embeds)
    again = sampler.sample(settings, embeds)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    cosine = F.cosine_similarity(first.flatten(), reference.flatten(), dim=0).item()
    assert LATENT_COSINE[path] <= cosine < 1, cosine


@pytest.mark.parametrize("path", ["int8", "fp8"])
def test_a_lora_on_an_8bit_path_moves_the_latents_as_on_fp16_and_strength_0_leaves_it_out(
    tiny_folder, tiny, fp16_latents, tmp_path, path
):
    embeds, _ = fp16_latents
    path_file = save_random_lora(tiny_folder, tmp_path / "lora.safetensors", seed=3)
    base = sampler_settings.SamplerSettings(tiny, **SETTINGS, **FP32, quantization="qint8", compute=path)
    without = sampler.sample(base, embeds)
    off = sampler.sample(dataclasses.replace(base, loras=(lora.LoraSpec(path_file, 0.0),)), embeds)
    torch.testing.assert_close(off, without, rtol=0, atol=0)
    on = sampler.sample(dataclasses.replace(base, loras=(lora.LoraSpec(path_file, 1.0),)), embeds)
    assert not torch.equal(on, without)
    # The same LoRA on the fp16 path moves the latents the same way.
    fp16 = dataclasses.replace(base, compute="fp16")
    fp16_on = sampler.sample(dataclasses.replace(fp16, loras=(lora.LoraSpec(path_file, 1.0),)), embeds)
    fp16_off = sampler.sample(fp16, embeds)
    moved, fp16_moved = (on - without).flatten(), (fp16_on - fp16_off).flatten()
    assert F.cosine_similarity(moved, fp16_moved, dim=0).item() > 0.9


def test_a_lora_on_an_8bit_layer_never_touches_its_weight(tiny_folder, tiny, tmp_path):
    settings = sampler_settings.SamplerSettings(tiny, **SETTINGS, **FP32, quantization="qint8", compute="fp8")
    model = transformer_run.prepare(
        quantized_transformer(settings.transformer), settings.scheme, torch.device("cpu"), compute="fp8"
    )
    layer = model.get_submodule("transformer_blocks.0.attn1.to_q")
    stored = layer.weight.clone()
    path_file = save_random_lora(tiny_folder, tmp_path / "lora.safetensors", seed=4)
    with lora.applied(model, [lora.LoraSpec(path_file, 1.0)]):
        assert layer.weight_patch is not None and layer.weight_dense is None
    assert all(name not in vars(layer) for name in ("weight_patch", *quanto.PATCHED))
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(layer.weight.view(torch.uint8), stored.view(torch.uint8))
