"""Bad input and warnings through a real ComfyUI server (the ``comfyui`` tier): every numeric input of the
sampler beyond its bounds is refused when queued and naming the input, at its bounds it runs; a prompt past
300 tokens and a size far from the model's own show a warning on the node; Free VRAM and Memory Snapshot
pass non-tensors (embeddings, conditioning) through unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest
from comfyui_support import SIZE, basic_prompt, node_id
from PIL import Image

from pixart_lowvram.core import contract, sampler_settings

pytestmark = pytest.mark.comfyui


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("width", contract.MAX_SIZE + contract.SIZE_MULTIPLE),
        ("height", contract.MIN_SIZE - contract.SIZE_MULTIPLE),
        ("height", 100),
        ("steps", 0),
        ("steps", sampler_settings.MAX_STEPS + 1),
        ("cfg", -0.5),
        ("cfg", sampler_settings.MAX_CFG + 1),
        ("seed", -1),
        ("seed", sampler_settings.MAX_SEED + 1),
        ("batch_size", 0),
        ("batch_size", sampler_settings.MAX_BATCH + 1),
        ("denoise", 1.5),
        ("denoise", -0.1),
    ],
)
def test_numeric_input_beyond_its_bounds_is_refused_when_queued(server, name, value):
    prompt = basic_prompt(**{name: value})
    response = server.queue(prompt)
    assert response.status_code == 400, response.text
    errors = response.json()["node_errors"][node_id(prompt, "PixArtQ_Sampler")]["errors"]
    assert any(name in json.dumps(error) for error in errors), errors


def test_numeric_inputs_at_their_bounds_run(server):
    prompt = basic_prompt(steps=1, cfg=0.0, seed=sampler_settings.MAX_SEED, batch_size=1, denoise=1.0)
    run = server.run(prompt)
    assert run.status == "success", run.error
    assert "text" not in run.outputs.get(node_id(prompt, "PixArtQ_Sampler"), {})


def test_prompt_past_300_tokens_shows_a_warning_on_the_encoder(server):
    prompt = basic_prompt(seed=61)
    encoder = node_id(prompt, "PixArtQ_T5Encode")
    prompt[encoder]["inputs"]["prompt"] = " ".join(f"red{i} cat" for i in range(200))
    run = server.run(prompt)
    assert run.status == "success", run.error
    warning = run.text(encoder)
    assert warning.startswith("prompt is ") and "T5 reads the first 300" in warning, warning
    assert "Shorten the prompt" in warning


def test_a_short_prompt_shows_no_warning(server):
    prompt = basic_prompt(seed=62)
    run = server.run(prompt)
    assert run.status == "success", run.error
    assert node_id(prompt, "PixArtQ_T5Encode") not in run.outputs


def test_a_size_far_from_the_models_own_warns_on_the_sampler(server):
    # The tiny model's own size is 64 px; 256² is 16× its area, as 2048² is on the 512 model.
    prompt = basic_prompt(seed=63, width=4 * SIZE, height=4 * SIZE)
    run = server.run(prompt)
    assert run.status == "success", run.error
    warning = run.text(node_id(prompt, "PixArtQ_Sampler"))
    assert f"{4 * SIZE}×{4 * SIZE}" in warning and f"native {SIZE}×{SIZE}" in warning, warning


def test_pass_through_nodes_carry_non_tensors(server):
    """Embeddings (a dataclass) through Free VRAM and Memory Snapshot into the sampler, and CONDITIONING (a
    list) through Free VRAM: the chain runs and gives the image of the direct chain."""
    prompt = basic_prompt(seed=64)
    encoder, chain = node_id(prompt, "PixArtQ_T5Encode"), node_id(prompt, "PixArtQ_Sampler")
    prompt["free_embeds"] = {"class_type": "PixArtQ_FreeVRAM", "inputs": {"value": [encoder, 0]}}
    prompt["snapshot_embeds"] = {
        "class_type": "PixArtQ_MemorySnapshot",
        "inputs": {"value": ["free_embeds", 0], "filename_prefix": "pass_through"},
    }
    prompt["free_conditioning"] = {"class_type": "PixArtQ_FreeVRAM", "inputs": {"value": [encoder, 1]}}
    prompt[chain]["inputs"]["embeds"] = ["snapshot_embeds", 0]
    run = server.run(prompt)
    assert run.status == "success", run.error
    assert {"free_embeds", "snapshot_embeds", "free_conditioning", chain} <= set(run.executed)
    (through,) = run.outputs[node_id(prompt, "SaveImage")]["images"]

    direct = server.run(basic_prompt(seed=64))
    assert direct.status == "success", direct.error
    (plain,) = direct.outputs[node_id(prompt, "SaveImage")]["images"]
    # The pixels, not the files: SaveImage writes each prompt's graph into its PNG.
    first, second = (
        np.asarray(Image.open(server.output / image["subfolder"] / image["filename"]).convert("RGB"))
        for image in (through, plain)
    )
    assert np.array_equal(first, second)
