"""The bundled API workflows on the tiny random model, as the comfyui tier runs them and
tools/same_images.py compares them: the model's name in models/diffusers, its native size, few steps, the
random LoRA's scale, the command-line arguments that point a workflow at it, and where the
ComfyUI-Distributed snapshot the distributed example needs lives.

Nothing here imports ComfyUI, pytest or the tests.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-pixart"  # its folder's name in models/diffusers
SIZE, STEPS = 64, 3  # the tiny model's native size
# ComfyUI's PixArt works its position embedding's base size out from the image, to 0 below about 320 px
# (a division by zero): a workflow through core's KSampler runs the tiny model at this size (its Empty
# Latent Image), not the native SIZE.
KSAMPLER_SIZE = 320
LORA_SCALE = 0.15  # save_random_lora's scale for the LoRA the LoRA + KSampler workflow loads
# ComfyUI-Distributed, the engine tests/test_comfyui_distributed.py scales out on: an unmodified snapshot
# beside the repository, as the ComfyUI checkouts are (.ci/comfyui), and its folder name in custom_nodes/.
DISTRIBUTED = REPO.parent / "shared" / "engines" / "ComfyUI-Distributed"
DISTRIBUTED_LINK = "ComfyUI-Distributed"


def tiny_sets(path: Path, model: str = MODEL) -> list[str]:
    """The arguments that put a bundled API workflow on the tiny model at its native size (core's KSampler:
    KSAMPLER_SIZE), few steps: --model and --size, as a user points a workflow at another model, and --set
    for the steps."""
    size = tiny_size(path)
    sets = [f"--model={model}", f"--size={size}x{size}"]
    for key, entry in json.loads(path.read_text(encoding="utf-8")).items():
        if entry["class_type"] in ("PixArtQ_Sampler", "KSampler"):
            sets.append(f"--set={key}.steps={STEPS}")
    return sets


def tiny_size(path: Path) -> int:
    """The image size of a bundled API workflow set by tiny_sets."""
    workflow = json.loads(path.read_text(encoding="utf-8"))
    kinds = {entry["class_type"] for entry in workflow.values()}
    return KSAMPLER_SIZE if "EmptyLatentImage" in kinds else SIZE
