"""The pack next to ComfyUI's own models and memory manager, in a real ComfyUI server (the ``comfyui`` tier):
core VAE nodes on the pack's LATENT and the other way round, the SDXL VAE as a single file from models/vae,
and kept models released by ComfyUI's /free, its unload_all_models and Free VRAM.

The module's server (``running_server`` in comfyui_support.py) also holds the tiny model's VAE as
models/vae/sdxl_vae.safetensors (the ``sdxl_vae_file`` fixture: original key layout, same weights).
"""

from __future__ import annotations

import numpy as np
import pytest
from comfyui_support import SDXL_VAE_FILE, Run, basic_prompt, node_id, running_server
from PIL import Image

pytestmark = pytest.mark.comfyui  # skipped without COMFYUI_PATH (conftest.py)

# Both decoders run in float32 on the CPU; the saved PNGs may differ by one level where a value sits on
# a rounding boundary.
PNG_LEVELS = 1


@pytest.fixture(scope="module")
def server(request, tmp_path_factory, tiny_folder, sdxl_vae_file):
    with running_server(
        request, tmp_path_factory.mktemp("comfyui"), tiny_folder, sdxl_vae_file=sdxl_vae_file
    ) as started:
        yield started


def saved_images(server, run: Run, node: str) -> list[np.ndarray]:
    """The images a SaveImage node wrote, as uint8 arrays."""
    assert run.status == "success", run.error
    images = run.outputs[node]["images"]
    return [
        np.asarray(Image.open(server.output / i["subfolder"] / i["filename"]).convert("RGB")) for i in images
    ]


def with_core_decode(prompt: dict, latent: list, prefix: str) -> dict:
    """``prompt`` plus core VAELoader (sdxl_vae.safetensors) → VAEDecode → SaveImage on ``latent``."""
    return prompt | {
        "core_vae": {"class_type": "VAELoader", "inputs": {"vae_name": SDXL_VAE_FILE}},
        "core_decode": {"class_type": "VAEDecode", "inputs": {"samples": latent, "vae": ["core_vae", 0]}},
        "core_save": {
            "class_type": "SaveImage",
            "inputs": {"images": ["core_decode", 0], "filename_prefix": prefix},
        },
    }


def test_core_vae_decode_of_the_pack_latent_equals_the_pack_decode(server):
    prompt = basic_prompt(seed=5)
    sampler = node_id(prompt, "PixArtQ_Sampler")
    save = node_id(prompt, "SaveImage")
    prompt[save]["inputs"]["filename_prefix"] = "pack_decode"
    run = server.run(with_core_decode(prompt, [sampler, 0], "core_decode"))
    (pack,) = saved_images(server, run, save)
    (core,) = saved_images(server, run, "core_save")
    assert pack.shape == core.shape == (64, 64, 3)
    assert pack.std() > 10, "the decode is flat: the comparison would prove nothing"
    difference = np.abs(pack.astype(int) - core.astype(int))
    assert difference.max() <= PNG_LEVELS, difference.max()
