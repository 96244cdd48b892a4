from __future__ import annotations

from comfy_api.latest import io

from ..core import text_encoder
from ..core.quant import TEXT_ENCODER_SCHEMES
from . import common


class QuantizedT5Encode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PixArtQ_T5Encode",
            display_name="Quantized T5 Encode",
            category=common.CATEGORY,
            description="Encodes the prompt and negative prompt with PixArt-Σ's T5-XXL loaded in 4-bit "
            "(or 8-bit) with bitsandbytes, then unloads T5. The embeddings stay on the CPU.",
            inputs=[
                common.model_input(),
                io.String.Input("prompt", multiline=True, default="", tooltip="What the image shows."),
                io.String.Input(
                    "negative_prompt",
                    multiline=True,
                    default="",
                    tooltip="What to steer away from (may be empty).",
                ),
                io.Combo.Input(
                    "quantization",
                    options=list(TEXT_ENCODER_SCHEMES),
                    default=TEXT_ENCODER_SCHEMES[0],
                    tooltip="nf4: bitsandbytes 4-bit NormalFloat, double quant, bf16 compute, every linear layer "
                    "(smallest). nf4-recipe: the notebook recipe's nf4, T5's wo projections left in bf16 (+1.5 GB). "
                    "fp4: 4-bit float. int8: bitsandbytes 8-bit, wo left in bf16. none: bf16 weights (largest).",
                ),
                common.keep_loaded_input(),
            ],
            outputs=[
                common.PixArtEmbeds.Output(
                    display_name="embeds",
                    tooltip="Prompt and negative embeddings with attention masks (300 tokens), on the CPU.",
                )
            ],
            hidden=[io.Hidden.dynprompt],
        )

    @classmethod
    def execute(cls, model, prompt, negative_prompt, quantization, keep_loaded) -> io.NodeOutput:
        report = common.begin_stage(cls.hidden.dynprompt)
        embeds = text_encoder.encode(
            common.resolve(model),
            prompt,
            negative_prompt,
            quantization=quantization,
            device=common.device(),
            keep_loaded=keep_loaded,
            quant_cache_dir=common.quant_cache_dir(),
            report=report,
        )
        return io.NodeOutput(embeds)
