from __future__ import annotations

from pathlib import Path

import folder_paths
from comfy_api.latest import io

from ..core import lora, transformer
from . import common, int8_model
from .sampler import transformer_file_input, transformer_path


class PixArtInt8ModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PixArtQ_ModelLoader",
            display_name="PixArt-Σ int8 Model Loader",
            category=common.CATEGORY,
            description="Loads the PixArt-Σ transformer with int8 (or float8) weights through optimum-quanto, "
            "from the same folders, single files and pre-quantized cache as the Quanto PixArt Sampler, as a "
            "ComfyUI MODEL: core's KSampler, SamplerCustomAdvanced, LoraLoaderModelOnly and model patches take "
            "it, and ComfyUI's model management loads, offloads and frees it. LoRAs apply at run time over the "
            "int8 weights. Condition it with Quantized T5 Encode's CONDITIONING outputs.",
            inputs=common.node_inputs(
                transformer.LOADER_INPUTS,
                model=common.model_input(),
                transformer_file=transformer_file_input(),
                keep_loaded=io.Boolean.Input(
                    "keep_loaded",
                    default=False,
                    optional=True,
                    tooltip="On: the MODEL stays on the GPU between prompts, as ComfyUI keeps its own models "
                    "until it needs the room. Off: after each sampling run ComfyUI moves it to CPU memory, where "
                    "its int8 weights wait page-locked, and the next run copies them back (0.6 GB at full size; "
                    "ComfyUI's unload and load back take 0.1–0.15 s a prompt on an H200): T5 and the VAE then "
                    "have the GPU to themselves, as in the Quanto PixArt Sampler's workflows.",
                ),
            ),
            outputs=[
                io.Model.Output(
                    tooltip="The transformer as a ComfyUI MODEL (PixArt-Σ, SDXL latents: decode with the SDXL "
                    "VAE or VAE Decode (PixArt-Σ))."
                )
            ],
        )

    @classmethod
    def execute(cls, model, transformer_file=common.FROM_MODEL, keep_loaded=False, **given) -> io.NodeOutput:
        settings = transformer.TransformerSettings(
            common.resolve(model),
            device=common.device(),
            transformer_file=transformer_path(transformer_file),
            quant_cache=common.quant_cache_dir(),
            **transformer.LOADER_INPUTS.settings_values(given),
        )
        with common.comfy_advice():
            return io.NodeOutput(int8_model.load(settings, keep_loaded))


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
