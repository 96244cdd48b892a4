from __future__ import annotations

from comfy_api.latest import io

from ..core import transformer
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
            eight_bit_auto=True,
            **transformer.LOADER_INPUTS.settings_values(given),
        )
        with common.comfy_advice():
            return io.NodeOutput(int8_model.load(settings, keep_loaded))
