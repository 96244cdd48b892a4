"""The pack's int8 transformer as a ComfyUI MODEL, in a real server (the ``comfyui`` tier): the bundled
LoRA workflow's graph — Quantized T5 Encode → PixArt-Σ int8 Model Loader → core's LoraLoaderModelOnly →
core's KSampler → VAE Decode (PixArt-Σ) → SaveImage — on the tiny model, with a random LoRA in
models/loras: strength 1 changes the image, strength 0 gives the image without it, ``/free`` lets the
model go and a prompt after runs; and the Quanto PixArt Sampler with the PixArt-Σ LoRA node."""

from __future__ import annotations

import json

import numpy as np
import pytest
import requests
import torch
from comfyui_support import HTTP_TIMEOUT, MODEL, REPO, STEPS, node_id, running_server, wait_for_log
from PIL import Image
from safetensors.torch import save_file

from pixart_lowvram.cli.random_model import save_random_lora
from pixart_lowvram.core import lora

pytestmark = pytest.mark.comfyui

WORKFLOW = REPO / "workflows" / "api" / "pixart_lowvram_lora_ksampler_api.json"
LORA = "tiny-lora.safetensors"
NOT_A_LORA = "not-a-lora.safetensors"  # a safetensors file with no LoRA layers
# ComfyUI's PixArt works its position embedding's base size out from the image, to 0 below about 320 px
# (a division by zero): the tiny model runs through core's KSampler at this size, not its native 64 px.
SIZE = 320


@pytest.fixture(scope="module")
def server(request, tmp_path_factory, tiny_folder):
    base = tmp_path_factory.mktemp("comfyui")
    save_random_lora(tiny_folder, base / "models" / "loras" / LORA, scale=0.15)
    save_file({"a": torch.zeros(1)}, base / "models" / "loras" / NOT_A_LORA)
    with running_server(request, base, tiny_folder) as started:
        yield started


def lora_prompt(strength: float, seed: int = 3) -> dict:
    """The bundled workflow on the tiny model at its native size, few steps, the test's LoRA."""
    prompt = json.loads(WORKFLOW.read_text(encoding="utf-8"))
    for node in prompt.values():
        if "model" in node["inputs"] and isinstance(node["inputs"]["model"], str):
            node["inputs"]["model"] = MODEL
    prompt[node_id(prompt, "LoraLoaderModelOnly")]["inputs"].update(lora_name=LORA, strength_model=strength)
    prompt[node_id(prompt, "EmptyLatentImage")]["inputs"].update(width=SIZE, height=SIZE)
    prompt[node_id(prompt, "KSampler")]["inputs"].update(steps=STEPS, seed=seed)
    return prompt


def without_lora(prompt: dict) -> dict:
    """The same graph with the loader's MODEL straight into KSampler."""
    lora = node_id(prompt, "LoraLoaderModelOnly")
    prompt = {key: node for key, node in prompt.items() if key != lora}
    prompt[node_id(prompt, "KSampler")]["inputs"]["model"] = [node_id(prompt, "PixArtQ_ModelLoader"), 0]
    return prompt


def image(server, prompt: dict) -> np.ndarray:
    run = server.run(prompt)
    assert run.status == "success", run.error
    (saved,) = run.outputs[node_id(prompt, "SaveImage")]["images"]
    return np.asarray(Image.open(server.output / saved["subfolder"] / saved["filename"]).convert("RGB"))


def options(entry: list) -> list:
    """A combo's options in /object_info: ``[[...], {...}]``, or ``["COMBO", {"options": [...]}]`` (V3)."""
    return entry[0] if isinstance(entry[0], list) else entry[1]["options"]


def test_the_loader_offers_the_models_and_core_loras_find_the_file(server):
    info = server.get("/object_info/PixArtQ_ModelLoader")["PixArtQ_ModelLoader"]
    assert MODEL in options(info["input"]["required"]["model"])
    assert info["output"] == ["MODEL"]
    loras = server.get("/object_info/LoraLoaderModelOnly")["LoraLoaderModelOnly"]["input"]["required"]
    assert LORA in options(loras["lora_name"])


def test_a_lora_through_core_nodes_on_the_packs_model(server):
    start = server.log.stat().st_size
    plain = image(server, without_lora(lora_prompt(1.0)))
    with_lora = image(server, lora_prompt(1.0))
    at_zero = image(server, lora_prompt(0.0))
    log = server.log_text(start)
    assert "Traceback" not in log
    assert "lora key not loaded" not in log  # every key of the file reached a layer
    assert np.abs(with_lora.astype(int) - plain.astype(int)).mean() > 2, "strength 1 changes the image"
    # Strength 0: core's loader adds no patch, so the same computation as without the LoRA.
    assert np.array_equal(at_zero, plain)
    # The LoRA's patches are taken off after its run: the model alone gives its own image again.
    assert np.array_equal(image(server, without_lora(lora_prompt(1.0))), plain)


def kept(prompt: dict, keep: bool = True) -> dict:
    """The prompt with the int8 Model Loader's keep_loaded set."""
    prompt[node_id(prompt, "PixArtQ_ModelLoader")]["inputs"]["keep_loaded"] = keep
    return prompt


def test_free_lets_a_kept_model_go_and_a_prompt_after_runs(server):
    first = image(server, kept(lora_prompt(1.0, seed=11)))
    start = server.log.stat().st_size
    image(server, kept(lora_prompt(1.0, seed=12)))
    assert "Requested to load PixArt" not in server.log_text(start), "a kept MODEL stays loaded"
    freed = server.log.stat().st_size
    for _attempt in range(6):  # ComfyUI frees when its prompt worker wakes: seen when it lets go of the nodes
        response = requests.post(
            server.url + "/free", json={"unload_models": True, "free_memory": True}, timeout=HTTP_TIMEOUT
        )
        assert response.status_code == 200
        if wait_for_log(server, freed, "ComfyUI let go of the pack's nodes", 1, deadline_s=10):
            break
    # The next prompt loads the MODEL anew.
    start = server.log.stat().st_size
    assert np.array_equal(image(server, kept(lora_prompt(1.0, seed=11))), first)
    assert "Requested to load PixArt" in server.log_text(start), "/free let the MODEL go"


def test_a_model_not_kept_leaves_after_each_run_and_gives_the_same_image(server):
    """keep_loaded off (the bundled workflow's, the loader's default): ComfyUI unloads the MODEL after each
    run and loads it for the next, which gives the kept MODEL's image."""
    first = image(server, kept(lora_prompt(1.0, seed=13)))
    images = []
    for seed in (13, 14):  # the second prompt reuses the first's MODEL (the loader's output is cached)
        start = server.log.stat().st_size
        images.append(image(server, kept(lora_prompt(1.0, seed=seed), keep=False)))
        assert "Requested to load PixArt" in server.log_text(start), "the MODEL left after its run"
    assert np.array_equal(images[0], first) and not np.array_equal(images[1], first)


def test_the_packs_sampler_takes_the_lora_node(server):
    from comfyui_support import basic_prompt

    prompt = basic_prompt()
    sampler = node_id(prompt, "PixArtQ_Sampler")
    plain = image(server, prompt)
    prompt["lora"] = {"class_type": "PixArtQ_LoRA", "inputs": {"lora_name": LORA, "strength": 1.0}}
    prompt[sampler]["inputs"]["loras"] = ["lora", 0]
    with_lora = image(server, prompt)
    prompt["lora"]["inputs"]["strength"] = 0.0
    at_zero = image(server, prompt)
    assert np.abs(with_lora.astype(int) - plain.astype(int)).mean() > 2
    assert np.array_equal(at_zero, plain)


def computing(prompt: dict, compute: str) -> dict:
    prompt[node_id(prompt, "PixArtQ_ModelLoader")]["inputs"]["compute"] = compute
    return prompt


def test_the_loader_computes_in_8_bits_with_core_loras_in_the_weights(server):
    """The loader's ``compute`` int8 (on the CPU: eager, the same arithmetic as the GPU's compiled blocks):
    an image close to compute fp16's, a LoRA through core's loader runs in the 8-bit weights (strength 1
    changes the image, strength 0 gives the image without it), the same image twice."""
    start = server.log.stat().st_size
    fp16 = image(server, without_lora(lora_prompt(1.0)))
    plain = image(server, computing(without_lora(lora_prompt(1.0)), "int8"))
    with_lora = image(server, computing(lora_prompt(1.0), "int8"))
    at_zero = image(server, computing(lora_prompt(0.0), "int8"))
    assert "Traceback" not in server.log_text(start)
    difference = np.abs(plain.astype(int) - fp16.astype(int)).mean()
    assert 0 < difference < 2, f"int8 compute moved the image by {difference} levels on average"
    assert np.abs(with_lora.astype(int) - plain.astype(int)).mean() > 2
    assert np.array_equal(at_zero, plain)
    assert np.array_equal(image(server, computing(without_lora(lora_prompt(1.0)), "int8")), plain)


def test_a_bad_compute_is_refused_in_one_line(server):
    prompt = computing(without_lora(lora_prompt(1.0)), "int8")
    prompt[node_id(prompt, "PixArtQ_ModelLoader")]["inputs"]["quantization"] = "qfloat8"
    run = server.run(prompt)
    assert run.status == "error"
    assert run.error["exception_type"] == "ValueError"
    assert (
        "compute 'int8' runs on qint8 weights, and quantization is 'qfloat8'"
        in run.error["exception_message"]
    )


def test_a_file_that_is_not_a_lora_is_refused_when_queued_with_the_command_lines_message(server):
    """Refused by the LoRA node's validation, before any node runs (T5 included), in the words of the
    command line's --lora."""
    from comfyui_support import basic_prompt

    prompt = basic_prompt()
    prompt["lora"] = {"class_type": "PixArtQ_LoRA", "inputs": {"lora_name": NOT_A_LORA, "strength": 1.0}}
    prompt[node_id(prompt, "PixArtQ_Sampler")]["inputs"]["loras"] = ["lora", 0]
    response = server.queue(prompt)
    assert response.status_code == 400, response.text
    with pytest.raises(ValueError) as expected:
        lora.check_file(server.base / "models" / "loras" / NOT_A_LORA)
    errors = response.json()["node_errors"]["lora"]["errors"]
    assert any(str(expected.value) in error.get("details", "") for error in errors), errors
