"""Every error names what was wrong (the input, its value) and how to fix it, and bad inputs are
rejected before any model is loaded."""

from __future__ import annotations

import sys

import pytest
import torch

from pixart_lowvram.core import outputs, sampler, sampler_settings, text_encoder, vae
from pixart_lowvram.core.contract import PixArtEmbeds
from pixart_lowvram.core.devices import resolve_dtype
from pixart_lowvram.core.models import find_model_folders, resolve_model
from pixart_lowvram.core.quant import TEXT_ENCODER_SCHEMES, TRANSFORMER_SCHEMES, choose

CPU = torch.device("cpu")


def message_has(exc_info: pytest.ExceptionInfo, *parts: str) -> None:
    message = str(exc_info.value)
    missing = [p for p in parts if p not in message]
    assert not missing, f"{missing} not in: {message}"


# --- model folders -------------------------------------------------------------------------------


def test_unknown_model_names_the_searched_folders(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        resolve_model("nope", roots=[tmp_path])
    message_has(info, "'nope'", "not found", str(tmp_path), "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS")
    message_has(info, "model_index.json")


def test_empty_model_name(tmp_path):
    with pytest.raises(ValueError) as info:
        resolve_model("  ", roots=[tmp_path])
    message_has(info, "no model given", "model_index.json")


def test_folder_without_model_index(tmp_path):
    (tmp_path / "half" / "vae").mkdir(parents=True)
    with pytest.raises(FileNotFoundError) as info:
        resolve_model("half", roots=[tmp_path])
    message_has(info, str(tmp_path / "half"), "no model_index.json", "text_encoder", "transformer")


def test_folder_missing_a_component(tmp_path):
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "model_index.json").write_text("{}")
    source = resolve_model("partial", roots=[tmp_path])
    with pytest.raises(FileNotFoundError) as info:
        source.config("vae")
    message_has(info, "'partial'", "no vae/ subfolder", "model_index.json")


def test_find_model_folders_finds_nested_models_only(tmp_path):
    for folder in ("a", "b/c", "a/text_encoder", ".hidden/x"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "model_index.json").write_text("{}")
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "config.json").write_text("{}")
    other = tmp_path.parent / (tmp_path.name + "_other")
    (other / "f").mkdir(parents=True)
    (other / "f" / "model_index.json").write_text("{}")
    # A root that is itself a model is not a choice, and neither are its subfolders.
    itself = tmp_path.parent / (tmp_path.name + "_itself")
    (itself / "g").mkdir(parents=True)
    (itself / "model_index.json").write_text("{}")
    (itself / "g" / "model_index.json").write_text("{}")

    found = find_model_folders([tmp_path, other, itself, tmp_path / "missing"])
    assert found == ["a", "b/c", "f"]


def _offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_hub_id_offline_says_where_to_put_the_files(tmp_path, monkeypatch):
    _offline(monkeypatch)
    roots = [tmp_path / "diffusers", tmp_path / "pixart"]
    source = resolve_model("pixart-lowvram-tests/no-such-model", roots=roots)
    assert source.hub_id == "pixart-lowvram-tests/no-such-model" and source.path is None
    with pytest.raises(FileNotFoundError) as info:
        source.config("vae")
    message_has(
        info,
        "'pixart-lowvram-tests/no-such-model'",
        "not on this machine",
        str(roots[0]),
        str(roots[1]),
        "HF_HUB_OFFLINE",
        "model_index.json",
    )


def test_following_the_offline_advice_resolves_locally(tmp_path, monkeypatch):
    _offline(monkeypatch)
    name = "pixart-lowvram-tests/no-such-model"
    with pytest.raises(FileNotFoundError) as info:
        resolve_model(name, roots=[tmp_path]).config("vae")
    suggested = str(info.value).split("e.g. ")[1].split(" with model_index.json")[0]
    (tmp_path / suggested).mkdir(parents=True)
    (tmp_path / suggested / "model_index.json").write_text("{}")
    assert resolve_model(name, roots=[tmp_path]).path is not None


# --- sampler settings, checked before anything loads ----------------------------------------------


@pytest.mark.parametrize(
    ("setting", "exc_type", "parts"),
    [
        ({"width": 72}, ValueError, ("width 72", "multiple of 16", "64 or 80")),
        ({"height": 100}, ValueError, ("height 100", "multiple of 16", "96 or 112")),
        ({"width": 32}, ValueError, ("width 32", "out of range", "64..4096")),
        ({"height": 8192}, ValueError, ("height 8192", "out of range", "64..4096")),
        ({"width": 64.0}, TypeError, ("width", "whole number", "64.0")),
        ({"steps": 0}, ValueError, ("steps 0", "out of range", "1..1000")),
        ({"cfg": -1.0}, ValueError, ("cfg -1.0", "0..100")),
        ({"cfg": 101.0}, ValueError, ("cfg 101.0", "0..100")),
        ({"cfg": float("nan")}, ValueError, ("cfg nan", "0..100")),
        ({"seed": -1}, ValueError, ("seed -1", f"0..{2**64 - 1}")),
        ({"seed": 2**64}, ValueError, (f"seed {2**64}", "out of range")),
        ({"batch_size": 0}, ValueError, ("batch_size 0", "1..64")),
        ({"batch_size": 65}, ValueError, ("batch_size 65", "1..64")),
        ({"quantization": "q3"}, ValueError, ("'q3'", "qint8")),
        ({"quantization": "nf4"}, ValueError, ("'nf4'", "not offered", "qint8")),
        ({"precision": "fp8"}, ValueError, ("precision 'fp8'", "fp16", "bf16", "fp32")),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else None,
)
def test_bad_sampler_settings(tiny, reference, load_spy, setting, exc_type, parts):
    settings = {"width": 64, "height": 64, "steps": 2, "device": "cpu", **setting}
    with pytest.raises(exc_type) as info:
        sampler.sample(sampler_settings.SamplerSettings(tiny, **settings), reference.embeds)
    message_has(info, *parts)
    assert load_spy.total() == 0


def test_embeds_of_another_width(tiny, reference, load_spy):
    embeds = PixArtEmbeds(
        prompt_embeds=torch.zeros(1, 300, 32),
        prompt_mask=torch.ones(1, 300, dtype=torch.long),
        negative_embeds=torch.zeros(1, 300, 32),
        negative_mask=torch.ones(1, 300, dtype=torch.long),
        model="elsewhere",
        quantization="none",
        dtype=torch.float32,
    )
    settings = sampler_settings.SamplerSettings(tiny, width=64, height=64, steps=2, device="cpu")
    with pytest.raises(ValueError) as info:
        sampler.sample(settings, embeds)
    message_has(info, "embeds", "32 wide", "expects 64", "same PixArt-Σ model")
    assert load_spy.total() == 0


def test_embeds_of_another_type(tiny, reference, load_spy):
    settings = sampler_settings.SamplerSettings(tiny, width=64, height=64, steps=2, device="cpu")
    with pytest.raises(TypeError) as info:
        sampler.sample(settings, reference.embeds.prompt_embeds)
    message_has(info, "embeds", "PIXART_EMBEDS", "Tensor")
    assert load_spy.total() == 0


# --- VAE decode -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 16, 8, 8), (4, 8, 8)])
def test_latent_of_wrong_shape(tiny, load_spy, shape):
    with pytest.raises(ValueError) as info:
        vae.decode(vae.DecoderSettings(tiny, device="cpu"), torch.zeros(shape))
    message_has(info, f"latent has shape {shape}", "[batch, 4, height/8, width/8]", "LATENT")
    assert load_spy.total() == 0


def test_latent_that_is_not_a_tensor(tiny, reference, load_spy):
    with pytest.raises(TypeError) as info:
        vae.decode(vae.DecoderSettings(tiny, device="cpu"), {"samples": reference.latents})
    message_has(info, "latent", "tensor under 'samples'", "dict")
    assert load_spy.total() == 0


# --- quantization -----------------------------------------------------------------------------------


def test_bitsandbytes_missing(tiny, load_spy, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ImportError) as info:
        choose("nf4", TEXT_ENCODER_SCHEMES, CPU)
    message_has(info, "'nf4'", "pip install bitsandbytes", "quantization 'none'")
    with pytest.raises(ImportError, match="pip install bitsandbytes"):
        text_encoder.encode(text_encoder.EncoderSettings(tiny, device="cpu"), "a cat")
    assert load_spy.total() == 0
    # Unquantized encoding still works without the package.
    unquantized = text_encoder.EncoderSettings(tiny, quantization="none", device="cpu")
    assert text_encoder.encode(unquantized, "a cat").batch == 1


def test_optimum_quanto_missing(tiny, reference, load_spy, monkeypatch):
    monkeypatch.setitem(sys.modules, "optimum.quanto", None)
    with pytest.raises(ImportError) as info:
        choose("qint8", TRANSFORMER_SCHEMES, CPU)
    message_has(info, "'qint8'", "pip install optimum-quanto", "quantization 'none'")
    with pytest.raises(ImportError, match="pip install optimum-quanto"):
        sampler.sample(
            sampler_settings.SamplerSettings(tiny, width=64, height=64, steps=2, device="cpu"),
            reference.embeds,
        )
    assert load_spy.total() == 0


@pytest.mark.parametrize(
    ("scheme", "offered", "package"),
    [("nf4", TEXT_ENCODER_SCHEMES, "bitsandbytes"), ("qint8", TRANSFORMER_SCHEMES, "optimum-quanto")],
)
def test_scheme_on_an_unsupported_device(scheme, offered, package):
    with pytest.raises(RuntimeError) as info:
        choose(scheme, offered, torch.device("mps"))
    message_has(info, f"'{scheme}'", package, "device 'mps'", "cpu", "cuda", "quantization 'none'")


def test_unknown_quantization():
    with pytest.raises(ValueError) as info:
        choose("q3", TEXT_ENCODER_SCHEMES, CPU)
    message_has(info, "'q3'", "nf4", "fp4", "int8", "none")


def test_scheme_of_the_other_stage(tiny, load_spy):
    with pytest.raises(ValueError) as info:
        text_encoder.encode(text_encoder.EncoderSettings(tiny, quantization="qint8", device="cpu"), "a cat")
    message_has(info, "'qint8'", "not offered", "nf4")
    assert load_spy.total() == 0


def test_unknown_precision():
    with pytest.raises(ValueError) as info:
        resolve_dtype("fp8", CPU, torch.float16, torch.float32)
    message_has(info, "precision 'fp8'", "auto", "fp16", "bf16", "fp32")


# --- output names -----------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["../x", "/abs", "a/b", "", "a..b", "a\\b", ".hidden"])
def test_prefix_cannot_leave_its_folder(tmp_path, prefix):
    with pytest.raises(ValueError) as info:
        outputs.check_prefix(prefix)
    message_has(info, "filename_prefix", repr(prefix), "no folders")
    with pytest.raises(ValueError):
        outputs.next_stem(tmp_path, prefix)


@pytest.mark.parametrize("prefix", ["pixart_memory", "PixArt-1.0"])
def test_prefix_accepted(tmp_path, prefix):
    assert outputs.check_prefix(prefix) == prefix
    assert outputs.next_stem(tmp_path, prefix) == tmp_path / f"{prefix}_00001"


@pytest.mark.parametrize(
    ("scheme", "capability", "ok", "advice"),
    [
        ("nf4", (6, 0), True, None),
        ("nf4", (5, 2), False, "'none'"),
        ("int8", (7, 5), True, None),
        ("int8", (6, 1), False, "'nf4'"),
        ("fp4", (9, 0), True, None),
    ],
)
def test_bitsandbytes_gpu_generation_is_checked(scheme, capability, ok, advice):
    from pixart_lowvram.core.quant.bitsandbytes import check_capability

    if ok:
        check_capability(scheme, capability, "some GPU")
        return
    with pytest.raises(RuntimeError) as error:
        check_capability(scheme, capability, "GeForce GTX 970")
    message = str(error.value)
    assert scheme in message and "GeForce GTX 970" in message and advice in message
    assert f"{capability[0]}.{capability[1]}" in message
