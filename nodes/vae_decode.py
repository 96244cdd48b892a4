from __future__ import annotations

from comfy_api.latest import io

from ..core import vae
from . import common


class PixArtVAEDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PixArtQ_VAEDecode",
            display_name="VAE Decode (PixArt-Σ)",
            category=common.CATEGORY,
            description="Decodes a LATENT with the PixArt-Σ model's VAE (the SDXL VAE), then unloads it.",
            inputs=[
                common.model_input(),
                io.Latent.Input("latent", tooltip="From Quanto PixArt Sampler or any SDXL-format LATENT."),
                common.keep_loaded_input(),
                io.Combo.Input(
                    "tiling",
                    options=list(vae.TILING),
                    default=vae.TILING[0],
                    optional=True,
                    tooltip=f"auto: decode in {vae.TILE_SIZE}-px tiles when the whole image would not fit in free "
                    "GPU memory (about 2.4 GiB at 1024²; tiles need 0.8 GiB). on: always tile. off: never.",
                ),
            ],
            outputs=[io.Image.Output(tooltip="Images [batch, height, width, 3], 0..1, on the CPU.")],
            hidden=[io.Hidden.dynprompt],
        )

    @classmethod
    def execute(cls, model, latent, keep_loaded, tiling="auto") -> io.NodeOutput:
        report = common.begin_stage(cls.hidden.dynprompt)
        samples = latent.get("samples") if isinstance(latent, dict) else latent
        images = vae.decode(
            common.resolve(model),
            samples,
            device=common.device(),
            keep_loaded=keep_loaded,
            tiling=tiling,
            report=report,
        )
        return io.NodeOutput(images)
