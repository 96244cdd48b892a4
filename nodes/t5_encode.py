from __future__ import annotations

from pathlib import Path

import comfy.model_management
import folder_paths
from comfy_api.latest import io, ui

from ..core import conditioning, text_encoder
from . import comfy_models, common


def t5_files() -> list[str]:
    """The safetensors files in ComfyUI's models/text_encoders folders (.bin/.pt are never offered)."""
    return [
        name
        for name in folder_paths.get_filename_list("text_encoders")
        if name.lower().endswith(".safetensors")
    ]


def comfy_t5_tokenizer() -> Path:
    """The T5 v1.1 tokenizer ComfyUI ships for its own T5 models, used when the PixArt folder has none."""
    # comfy is a namespace package (no __file__): locate it through one of its modules.
    return Path(comfy.model_management.__file__).parent / "text_encoders" / "t5_tokenizer"


class QuantizedT5Encode(comfy_models.HoldsModels, io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PixArtQ_T5Encode",
            display_name="Quantized T5 Encode",
            category=common.CATEGORY,
            description="Encodes the prompt and negative prompt with PixArt-Σ's T5-XXL loaded in 4-bit "
            "(or 8-bit) with bitsandbytes, then unloads T5. T5 comes from the model's folder or from a "
            "single T5-XXL file in models/text_encoders. The embeddings stay on the CPU; positive and negative "
            "offer them as core CONDITIONING for ComfyUI's own PixArt-Σ model and KSampler.",
            inputs=common.node_inputs(
                text_encoder.INPUTS,
                model=common.model_input(),
                t5_file=io.Combo.Input(
                    "t5_file",
                    options=[common.FROM_MODEL, *t5_files()],
                    default=common.FROM_MODEL,
                    optional=True,
                    tooltip="(from model): T5 from the model's text_encoder/ folder. Or a T5-XXL file from "
                    "models/text_encoders (t5xxl_fp16, t5xxl_fp8_e4m3fn, bf16, as SD3 and Flux use): quantized as "
                    "it loads, no second copy of T5 needed. The tokenizer still comes from the model's folder, "
                    "or from ComfyUI's own T5 tokenizer when the folder has none.",
                ),
            ),
            outputs=[
                common.PixArtEmbeds.Output(
                    display_name="embeds",
                    tooltip="Prompt and negative embeddings with attention masks (300 tokens), on the CPU.",
                ),
                # After embeds, so links saved to output 0 stay valid.
                io.Conditioning.Output(
                    display_name="positive",
                    tooltip="The prompt as ComfyUI's own PixArt text encoder gives it (its tokens, no padding), "
                    "for ComfyUI's PixArt-Σ model (Load Diffusion Model) with KSampler.",
                ),
                io.Conditioning.Output(
                    display_name="negative",
                    tooltip="The negative prompt in the same form (an empty one is the end token alone, as "
                    "ComfyUI's encoder makes it), for KSampler's negative input.",
                ),
            ],
            hidden=[io.Hidden.dynprompt],
        )

    @classmethod
    def execute(cls, model, prompt, negative_prompt, t5_file=common.FROM_MODEL, **given) -> io.NodeOutput:
        report = common.begin_stage(cls.hidden.dynprompt)
        settings = text_encoder.EncoderSettings(
            common.resolve(model),
            device=common.device(),
            t5_file=None
            if t5_file == common.FROM_MODEL
            else folder_paths.get_full_path_or_raise("text_encoders", t5_file),
            quant_cache=common.quant_cache_dir(),
            tokenizer_fallback=comfy_t5_tokenizer(),
            **text_encoder.INPUTS.settings_values(given),
        )
        warnings: list[str] = []
        with common.comfy_advice():
            embeds = text_encoder.encode(
                settings,
                prompt,
                negative_prompt,
                report=report,
                on_warning=warnings.append,
                on_progress=common.stage_progress(),
            )
        # Shown on the node: a prompt cut at 300 tokens.
        shown = ui.PreviewText("\n".join(warnings)) if warnings else None
        return io.NodeOutput(embeds, *conditioning.core_conditioning(embeds), ui=shown)
