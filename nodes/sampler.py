from __future__ import annotations

from comfy_api.latest import io

from ..core import sampler
from ..core.quant import TRANSFORMER_SCHEMES
from . import common


def _size_input(name: str) -> io.Int.Input:
    return io.Int.Input(
        name,
        default=1024,
        min=sampler.MIN_SIZE,
        max=sampler.MAX_SIZE,
        step=sampler.SIZE_MULTIPLE,
        tooltip=f"Image {name} in pixels, a multiple of {sampler.SIZE_MULTIPLE}.",
    )


class QuantoPixArtSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PixArtQ_Sampler",
            display_name="Quanto PixArt Sampler",
            category=common.CATEGORY,
            description="Loads the PixArt-Σ transformer with int8 (or float8) weights through optimum-quanto, "
            "samples latents with DPM-Solver++ from the embeddings, then unloads it. The LATENT is in raw VAE "
            "space like every ComfyUI sampler's, so core VAE Decode with the SDXL VAE reads it too.",
            inputs=[
                common.model_input(),
                common.PixArtEmbeds.Input("embeds", tooltip="From Quantized T5 Encode (same model family)."),
                *(_size_input(name) for name in ("width", "height")),
                io.Int.Input(
                    "steps",
                    default=20,
                    min=1,
                    max=sampler.MAX_STEPS,
                    tooltip="Denoising steps (DPM-Solver++).",
                ),
                io.Float.Input(
                    "cfg",
                    default=4.5,
                    min=0.0,
                    max=100.0,
                    step=0.1,
                    round=0.01,
                    tooltip="Classifier-free guidance scale; 1 or less turns guidance off.",
                ),
                io.Int.Input(
                    "seed",
                    default=0,
                    min=0,
                    max=sampler.MAX_SEED,
                    control_after_generate=True,
                    tooltip="Noise seed; noise is drawn on the CPU, so a seed gives the same image on any device.",
                ),
                io.Int.Input(
                    "batch_size", default=1, min=1, max=sampler.MAX_BATCH, tooltip="Images per prompt."
                ),
                io.Combo.Input(
                    "weights",
                    options=list(TRANSFORMER_SCHEMES),
                    default=TRANSFORMER_SCHEMES[0],
                    tooltip="qint8: optimum-quanto int8 weights, proj_out kept (the recipe's default). qfloat8: "
                    "float8 weights. none: fp16 on a GPU, bf16 on the CPU.",
                ),
                common.keep_loaded_input(),
            ],
            outputs=[
                io.Latent.Output(tooltip="Latents in raw VAE space (divided by the VAE scaling factor).")
            ],
            hidden=[io.Hidden.dynprompt],
        )

    @classmethod
    def validate_inputs(cls, width, height) -> bool | str:
        # ComfyUI does not enforce an INT's step: refuse a bad size when the prompt is queued.
        try:
            sampler.check_size("width", width)
            sampler.check_size("height", height)
        except (TypeError, ValueError) as exc:
            return str(exc)
        return True

    @classmethod
    def execute(
        cls, model, embeds, width, height, steps, cfg, seed, batch_size, weights, keep_loaded
    ) -> io.NodeOutput:
        report = common.begin_stage(cls.hidden.dynprompt)
        samples = sampler.sample(
            common.resolve(model),
            embeds,
            width=width,
            height=height,
            steps=steps,
            cfg=cfg,
            seed=seed,
            batch_size=batch_size,
            quantization=weights,
            device=common.device(),
            keep_loaded=keep_loaded,
            on_step=common.step_callback(steps),
            report=report,
        )
        return io.NodeOutput({"samples": samples})
