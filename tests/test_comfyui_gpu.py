"""The ComfyUI sequence on the GPU (``comfyui`` and ``gpu`` tiers: ``pytest -m "comfyui and gpu"`` on the GPU
machine, with COMFYUI_PATH): a real ComfyUI server started without --cpu, so with the version's defaults
(Dynamic VRAM on where it has it, e.g. v0.33.0), runs the ComfyUI sequence's steps (server_sequence.py) on the tiny
model — the pack loads, every bundled API workflow, keep_loaded prompts, POST /free, a third prompt, Cancel
during sampling and a prompt after it, a core VAE after kept pack models, /free again — and the allocated
memory after each /free is back to the level before the first prompt. And ComfyUI as a library on the GPU:
the int8 MODEL's 8-bit computes (int8, fp8; fused quantization on and off) under KSampler's sampling,
close to its fp16 compute, with a LoRA through ComfyUI's loading, and nothing left once unloaded; and the
same MODEL replayed from a CUDA graph a run (PIXART_LOWVRAM_CUDA_GRAPH=1) giving the same latents.

Skipped without CUDA (it is in the comfyui tier too, which runs on CPU machines).
"""

from __future__ import annotations

import functools

import pytest
import torch
from comfyui_support import MODEL, SIZE, STEPS, running_server
from server_sequence import Settings, run_sequence

pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs CUDA: run on the GPU machine (pytest -m 'comfyui and gpu')",
    ),
]

LIMIT_MIB = 64


@pytest.fixture(scope="module")
def sequence(request, tmp_path_factory, tiny_folder, sdxl_vae_file) -> dict:
    settings = Settings(
        model=MODEL, size=SIZE, ksampler_size=320, steps=STEPS, limit_mib=LIMIT_MIB, prompt_timeout=300
    )
    with running_server(
        request, tmp_path_factory.mktemp("comfyui"), tiny_folder, sdxl_vae_file=sdxl_vae_file, cpu=False
    ) as server:
        return run_sequence(server.url, server.log, settings)


def test_the_server_runs_on_the_gpu(sequence):
    assert sequence["server"]["device_type"] == "cuda", sequence["server"]


def test_every_step_succeeds(sequence):
    failed = {s["name"]: s.get("error") for s in sequence["steps"] if not s["passed"]}
    assert not failed, f"{failed}\nserver log, last lines:\n" + "\n".join(sequence["log"]["tail"])
    names = [s["name"] for s in sequence["steps"]]
    assert names[0] == "pack loaded" and names[-1] == "final /free", names


def test_every_bundled_workflow_ran(sequence):
    ran = {
        s["name"].removeprefix("workflow ") for s in sequence["steps"] if s["name"].startswith("workflow ")
    }
    assert ran == set(sequence["settings"]["workflows"]) and len(ran) >= 4


def test_no_traceback_in_the_server_log(sequence):
    log = sequence["log"]
    assert log["tracebacks"] == 0, "\n\n".join(log["traceback_excerpts"])


def test_allocated_after_free_is_back_to_the_level_before_the_first_prompt(sequence):
    check = sequence["memory_check"]
    assert check["passed"] is True, check["detail"]
    assert set(check["after_mib"]) == {"/free", "final /free"}


# ---- the int8 MODEL's 8-bit compute under KSampler, on the GPU --------------------------------------------


@pytest.fixture(scope="module")
def comfy_cuda():
    """ComfyUI importable as a library on the GPU (no --cpu): KSampler's sampling and its LoRA loading."""
    import os
    import sys
    from pathlib import Path

    saved_path = list(sys.path)
    sys.path.insert(0, str(Path(os.environ["COMFYUI_PATH"]).resolve()))
    try:
        import comfy.model_management
        import comfy.sample
        import comfy.sd
        import comfy.utils

        yield comfy
    finally:
        sys.path[:] = saved_path


def _ksampler(comfy, model, size: int = 272, seed: int = 5) -> torch.Tensor:
    """KSampler's sampling (what its node calls) on ``model``: a 40-token prompt and a one-token negative."""
    width = model.model.model_config.unet_config.get("caption_channels", 4096)
    generator = torch.Generator().manual_seed(1)
    positive = [[torch.randn(1, 40, width, generator=generator), {}]]
    negative = [[torch.randn(1, 1, width, generator=generator), {}]]
    latent = torch.zeros(1, 4, size // 8, size // 8)
    noise = comfy.sample.prepare_noise(latent, seed)
    with torch.inference_mode():
        return comfy.sample.sample(
            model, noise, 4, 4.5, "euler", "normal", positive, negative, latent, seed=seed
        ).float()


def _nothing_left(comfy, cuda, before: int) -> None:
    """Once ComfyUI unloads its models and the pack frees its own, the GPU holds what it held ``before``."""
    from pixart_lowvram.core.pool import free_all

    comfy.model_management.unload_all_models()
    free_all()
    comfy.model_management.soft_empty_cache()
    assert torch.cuda.memory_allocated(cuda) <= before


@pytest.mark.parametrize("fused", ["0", "1"])
@pytest.mark.parametrize("compute", ["int8", "fp8"])
def test_the_8bit_model_under_ksampler_on_cuda_close_to_fp16_with_lora_and_nothing_left(
    comfy_cuda, tiny_folder, tmp_path, monkeypatch, compute, fused
):
    """The int8 Model Loader's MODEL with an 8-bit compute under KSampler on the GPU (its blocks compiled,
    with and without the fused quantization kernels): latents close to the same MODEL's fp16 compute, the
    same bits twice, a LoRA through ComfyUI's own loading changes them and strength 0 gives them back, and
    once ComfyUI unloads its models and the pack frees its own the GPU holds what it held before."""
    from pixart_lowvram.cli.random_model import save_random_lora
    from pixart_lowvram.core.models import resolve_model
    from pixart_lowvram.core.quant import block as fused_block
    from pixart_lowvram.core.quant import compute as compute_paths
    from pixart_lowvram.core.transformer import TransformerSettings
    from pixart_lowvram.nodes import int8_model

    comfy = comfy_cuda
    cuda = comfy.model_management.get_torch_device()
    if reason := compute_paths.unable(compute, cuda):
        pytest.skip(reason)
    monkeypatch.setenv(fused_block.VARIABLE, fused)
    before = torch.cuda.memory_allocated(cuda)

    def model(choice: str):
        settings = TransformerSettings(
            resolve_model(str(tiny_folder)), device=cuda, compute=choice, quant_cache=tmp_path / "quantized"
        )
        return int8_model.load(settings, keep_loaded=False)

    fp16 = _ksampler(comfy, model("fp16"))
    eight = model(compute)
    first = _ksampler(comfy, eight)
    assert torch.equal(first, _ksampler(comfy, eight))
    cosine = torch.nn.functional.cosine_similarity(first.flatten(), fp16.flatten(), dim=0).item()
    assert 0.99 < cosine < 1, cosine
    path = save_random_lora(tiny_folder, tmp_path / "lora.safetensors", scale=0.15)
    state = comfy.utils.load_torch_file(str(path), safe_load=True)
    on = _ksampler(comfy, comfy.sd.load_lora_for_models(eight, None, state, 1.0, 0)[0])
    off = _ksampler(comfy, comfy.sd.load_lora_for_models(eight, None, state, 0.0, 0)[0])
    assert torch.nn.functional.cosine_similarity(on.flatten(), first.flatten(), dim=0).item() < 0.9999
    assert torch.equal(off, first)
    del eight
    _nothing_left(comfy, cuda, before)


def test_the_8bit_model_graphed_under_ksampler_gives_the_same_latents_and_nothing_left(
    comfy_cuda, tiny_folder, tmp_path, monkeypatch, caplog
):
    """The MODEL in fp8 (int8 where the card has no fp8) under KSampler with a LoRA, its forward replayed from
    a CUDA graph per run (PIXART_LOWVRAM_CUDA_GRAPH=1): one capture a run, no capture failed, the same
    latents as without the graph (the same kernels on the same inputs), and nothing left once unloaded."""
    from graph_stand_in import with_and_without_graph

    from pixart_lowvram.cli.random_model import save_random_lora
    from pixart_lowvram.core.models import resolve_model
    from pixart_lowvram.core.quant import compute as compute_paths
    from pixart_lowvram.core.transformer import TransformerSettings
    from pixart_lowvram.nodes import int8_model

    comfy = comfy_cuda
    cuda = comfy.model_management.get_torch_device()
    compute = "fp8" if compute_paths.unable("fp8", cuda) is None else "int8"
    if reason := compute_paths.unable(compute, cuda):
        pytest.skip(reason)
    before = torch.cuda.memory_allocated(cuda)
    settings = TransformerSettings(
        resolve_model(str(tiny_folder)), device=cuda, compute=compute, quant_cache=tmp_path / "quantized"
    )
    path = save_random_lora(tiny_folder, tmp_path / "lora.safetensors", scale=0.15)
    state = comfy.utils.load_torch_file(str(path), safe_load=True)
    loaded = int8_model.load(settings, keep_loaded=False)
    model = comfy.sd.load_lora_for_models(loaded, None, state, 1.0, 0)[0]
    plain, graphed, again = with_and_without_graph(
        functools.partial(_ksampler, comfy, model), monkeypatch, caplog
    )
    assert torch.equal(graphed, plain)
    assert torch.equal(again, graphed)
    del model, loaded
    _nothing_left(comfy, cuda, before)
