from __future__ import annotations

from pathlib import Path

import folder_paths
from comfy_api.latest import io

from ..core import lora
from . import common


class PixArtLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PixArtQ_LoRA",
            display_name="PixArt-Σ LoRA",
            category=common.CATEGORY,
            description="A LoRA for the Quanto PixArt Sampler, added at run time to the transformer's int8 "
            "weights (no float copy of the transformer). Chain several to stack them. For a MODEL from the "
            "PixArt-Σ int8 Model Loader, use core's LoraLoaderModelOnly instead.",
            inputs=[
                io.Combo.Input(
                    "lora_name",
                    options=folder_paths.get_filename_list("loras"),
                    tooltip="A PixArt-Σ LoRA (.safetensors) from models/loras: keys transformer.<layer>, "
                    "base_model.model.<layer> or unet.base_model.model.<layer>, with lora_A/lora_B or "
                    "lora_down/lora_up factors.",
                ),
                io.Float.Input(
                    "strength",
                    default=1.0,
                    min=-lora.MAX_STRENGTH,
                    max=lora.MAX_STRENGTH,
                    step=0.01,
                    tooltip="How strongly the LoRA applies: 1 as trained, 0 leaves it out, negative inverts it.",
                ),
                common.PixArtLoras.Input(
                    "loras", optional=True, tooltip="LoRAs from another PixArt-Σ LoRA node, applied first."
                ),
            ],
            outputs=[common.PixArtLoras.Output(tooltip="The LoRAs so far, for the sampler's loras input.")],
        )

    @classmethod
    def validate_inputs(cls, lora_name=None) -> bool | str:
        # Before any node runs: a file that is not a LoRA is refused before T5 or the transformer loads, with
        # the command line's message. Naming lora_name here leaves its list check to lora_path.
        if lora_name is None:  # linked: checked when the node runs
            return True
        try:
            lora.check_file(lora_path(lora_name))
        except (OSError, ValueError) as exc:
            return str(exc)
        return True

    @classmethod
    def execute(cls, lora_name, strength, loras=()) -> io.NodeOutput:
        return io.NodeOutput((*loras, lora.LoraSpec(lora_path(lora_name), strength)))


def lora_path(lora_name: str) -> Path:
    path = folder_paths.get_full_path("loras", lora_name)
    if path is None:
        raise FileNotFoundError(f"lora_name {lora_name!r} is not in models/loras; put the file there.")
    return Path(path)
