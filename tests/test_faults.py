"""Faults during a prompt: an out-of-memory inside each stage (simulated on the CPU by raising CUDA's
OutOfMemoryError from the loader or from the model's forward), a damaged or pickled weights file in the
model folder, the model folder deleted between prompts. Each gives an error that names the stage or file
and what to do, leaves nothing loaded, and the next prompt succeeds.

Covered elsewhere: cancel in the middle of sampling (test_unload.py raises from the step callback;
test_comfyui_server.py cancels through /interrupt), a truncated quantized-cache entry (test_quant_cache.py),
a forced out-of-memory on a real GPU (test_gpu.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from pixart_lowvram.core import measure, sampler, sampler_settings, text_encoder, transformer_run, vae
from pixart_lowvram.core.models import resolve_model
from pixart_lowvram.core.pool import cache

FP32 = {"device": "cpu", "precision": torch.float32}
# What core's advice says where a node adds "In ComfyUI: put Free VRAM before this node ...".
FREE_OTHERS = "free the GPU memory other models hold"
# The stage's name in the report, the module whose _load loads it, and words its advice must hold.
STAGES = {
    "text_encoder": ("t5_encode", text_encoder, ("low_vram", "nf4", FREE_OTHERS)),
    "transformer": ("sample", transformer_run, ("low_vram", "width, height or batch_size", FREE_OTHERS)),
    "vae": ("vae_decode", vae, ("tiling", "width, height or batch_size", FREE_OTHERS)),
}
WEIGHTS = {
    "text_encoder": "model.safetensors",
    "transformer": "diffusion_pytorch_model.safetensors",
    "vae": "diffusion_pytorch_model.safetensors",
}


def run(stage: str, source, reference, report=None, **options):
    options = {**FP32, **options}
    if stage == "text_encoder":
        settings = text_encoder.EncoderSettings(source, quantization="none", **options)
        cache.forget_results()  # T5 runs, not the remembered embeddings (test_t5_embeddings.py)
        return text_encoder.encode(settings, reference.prompt, reference.negative, report=report)
    if stage == "transformer":
        settings = sampler_settings.SamplerSettings(
            source, **reference.settings, quantization="none", **options
        )
        return sampler.sample(settings, reference.embeds, report=report)
    return vae.decode(vae.DecoderSettings(source, **options), reference.latents, report=report)


def same_as_reference(stage: str, result, reference) -> bool:
    """Bit for bit: ``run`` repeats the reference fixture's settings, the same kernels on the same data."""
    if stage == "text_encoder":
        return torch.equal(result.prompt_embeds, reference.embeds.prompt_embeds)
    return torch.equal(result, reference.latents if stage == "transformer" else reference.images)


def out_of_memory() -> torch.cuda.OutOfMemoryError:
    return torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


# --- out of memory ----------------------------------------------------------------------------------


def fail_once_in_forward(module, stage: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the stage's model raise OutOfMemoryError from its (first) forward, once."""
    calls: list[int] = []
    original = module._load

    def load(*args, **kwargs):
        model = original(*args, **kwargs)
        target = model.decoder if stage == "vae" else model  # the VAE runs decode(), not forward()

        def raise_once(_module, _inputs):
            if not calls:
                calls.append(1)
                raise out_of_memory()

        target.register_forward_pre_hook(raise_once)
        return model

    monkeypatch.setattr(module, "_load", load)
    return calls


@pytest.mark.parametrize("keep_loaded", [False, True], ids=["unload", "keep_loaded"])
@pytest.mark.parametrize("stage", list(STAGES))
def test_out_of_memory_in_the_forward_says_what_to_do_and_frees(
    tiny, reference, load_spy, monkeypatch, stage, keep_loaded
):
    name, module, advice = STAGES[stage]
    calls = fail_once_in_forward(module, stage, monkeypatch)
    report = measure.MemoryReport()
    with pytest.raises(torch.cuda.OutOfMemoryError) as info:
        run(stage, tiny, reference, keep_loaded=keep_loaded, report=report)
    assert calls == [1]
    message = str(info.value)
    for part in (f"stage {name} ran out of GPU memory", "Tried to allocate 2.00 GiB", *advice):
        assert part in message, f"{part!r} not in: {message}"
    assert isinstance(info.value.__cause__, torch.cuda.OutOfMemoryError)
    # Freed though the exception is still alive here, and not kept though keep_loaded asked for it.
    assert load_spy.alive(stage) == [False]
    assert len(cache) == 0
    assert [(r.stage, r.error) for r in report.stages] == [(name, "OutOfMemoryError")]

    # The next prompt (the same settings) loads afresh and succeeds.
    assert same_as_reference(stage, run(stage, tiny, reference), reference)
    assert load_spy.count(stage) == 2


@pytest.mark.parametrize("stage", list(STAGES))
def test_out_of_memory_while_loading_frees_what_was_loaded(tiny, reference, load_spy, monkeypatch, stage):
    name, module, _advice = STAGES[stage]
    original = module._load  # load_spy's wrapper: it sees the model before the failure

    def load_then_fail(*args, **kwargs):
        model = original(*args, **kwargs)  # noqa: F841 - held by this frame when the error is raised
        raise out_of_memory()  # as moving the loaded model to the GPU would

    monkeypatch.setattr(module, "_load", load_then_fail)
    with pytest.raises(torch.cuda.OutOfMemoryError, match=f"stage {name} ran out of GPU memory"):
        run(stage, tiny, reference)
    assert load_spy.alive(stage) == [False]
    monkeypatch.setattr(module, "_load", original)
    assert same_as_reference(stage, run(stage, tiny, reference), reference)


def test_stage_translates_only_out_of_memory():
    class Other(RuntimeError):
        pass

    with pytest.raises(Other) as info, measure.stage("sample", "cpu"):
        raise Other("unchanged")
    assert str(info.value) == "unchanged"
    with pytest.raises(torch.cuda.OutOfMemoryError) as info, measure.stage("some_stage", "cpu"):
        raise torch.cuda.OutOfMemoryError("")
    assert "stage some_stage ran out of GPU memory on cpu (OutOfMemoryError)" in str(info.value)
    assert measure.GENERIC_ADVICE in str(info.value)


# --- damaged or pickled weights in the model folder ---------------------------------------------------


def model_copy(tiny_folder: Path, folder: Path, component: str | None = None) -> Path:
    """``folder`` made like the tiny model out of links, ``component``/ a real folder (of links) so its
    weights file can be replaced without touching the shared model."""
    folder.mkdir(parents=True)
    for entry in tiny_folder.iterdir():
        if entry.name != component:
            (folder / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
            continue
        (folder / entry.name).mkdir()
        for file in entry.iterdir():
            (folder / entry.name / file.name).symlink_to(file)
    return folder


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    path.unlink()
    if how == "random bytes":
        path.write_bytes(os.urandom(len(data)))
    elif how == "bad header":
        path.write_bytes(data[:8] + b"{not json" + data[17:])
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:  # zero bytes: a download that never started
        path.write_bytes(b"")


@pytest.mark.parametrize("how", ["random bytes", "bad header", "truncated", "empty"])
@pytest.mark.parametrize("stage", list(STAGES))
def test_damaged_weights_file_is_named_before_loading(
    tiny, tiny_folder, reference, load_spy, tmp_path, stage, how
):
    folder = model_copy(tiny_folder, tmp_path / "damaged", stage)
    weights = folder / stage / WEIGHTS[stage]
    damage(weights, how)
    report = measure.MemoryReport()
    with pytest.raises(ValueError) as info:
        run(stage, resolve_model(str(folder)), reference, report=report)
    message = str(info.value)
    for part in (str(weights.resolve()), "not a readable safetensors file", "download", "again"):
        assert part in message, f"{part!r} not in: {message}"
    assert load_spy.total() == 0
    assert len(cache) == 0
    assert same_as_reference(stage, run(stage, tiny, reference), reference)


@pytest.mark.parametrize("stage", list(STAGES))
def test_weights_folder_without_safetensors(tiny_folder, reference, load_spy, tmp_path, stage):
    folder = model_copy(tiny_folder, tmp_path / "empty", stage)
    (folder / stage / WEIGHTS[stage]).unlink()
    with pytest.raises(FileNotFoundError) as info:
        run(stage, resolve_model(str(folder)), reference)
    message = str(info.value)
    assert "no .safetensors weights" in message and f"{stage}" in message, message
    assert load_spy.total() == 0


# --- the model folder deleted between prompts ---------------------------------------------------------


@pytest.mark.parametrize("stage", list(STAGES))
def test_model_folder_deleted_between_prompts(tiny_folder, reference, load_spy, tmp_path, stage):
    folder = model_copy(tiny_folder, tmp_path / "models" / "pixart", None)
    source = resolve_model("pixart", [tmp_path / "models"])
    assert same_as_reference(stage, run(stage, source, reference), reference)

    shutil.rmtree(folder)
    with pytest.raises(FileNotFoundError) as info:
        run(stage, source, reference)
    message = str(info.value)
    assert "'pixart'" in message and str(folder) in message and "model_index.json" in message, message
    with pytest.raises(FileNotFoundError, match="'pixart' was not found"):
        resolve_model("pixart", [tmp_path / "models"])

    model_copy(tiny_folder, folder, None)  # put back: the next prompt runs
    assert same_as_reference(
        stage, run(stage, resolve_model("pixart", [tmp_path / "models"]), reference), reference
    )
    assert load_spy.alive(stage) == [False, False]
