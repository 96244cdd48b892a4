from __future__ import annotations

import folder_paths
from comfy_api.latest import io

from ..core import vae
from . import comfy_models, common

LEGACY_FROM_MODEL = "(model folder)"  # vae_file's name for common.FROM_MODEL in earlier versions


class PixArtVAEDecode(comfy_models.HoldsModels, io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PixArtQ_VAEDecode",
            display_name="VAE Decode (PixArt-Σ)",
            category=common.CATEGORY,
            description="Decodes a LATENT with the PixArt-Σ model's VAE (the SDXL VAE), then unloads it.",
            inputs=common.node_inputs(
                vae.INPUTS,
                model=common.model_input(),
                latent=io.Latent.Input(
                    "latent", tooltip="From Quanto PixArt Sampler or any SDXL-format LATENT."
                ),
                vae_file=io.Combo.Input(
                    "vae_file",
                    options=[common.FROM_MODEL, *vae_files()],
                    default=common.FROM_MODEL,
                    optional=True,
                    tooltip="The SDXL VAE as one .safetensors file from models/vae (e.g. sdxl_vae.safetensors, "
                    "original or diffusers key layout), decoding with the model folder's VAE config; "
                    f"{common.FROM_MODEL} uses the model's own vae/.",
                ),
            ),
            outputs=[io.Image.Output(tooltip="Images [batch, height, width, 3], 0..1, on the CPU.")],
            hidden=[io.Hidden.dynprompt],
        )

    @classmethod
    def validate_inputs(cls, vae_file=common.FROM_MODEL) -> bool | str:
        # Naming vae_file here makes ComfyUI leave its list check to this function: workflows saved when the
        # choice was called "(model folder)" keep loading.
        if vae_file in (common.FROM_MODEL, LEGACY_FROM_MODEL, None) or vae_file in vae_files():
            return True
        return f"vae_file {vae_file!r} is not in ComfyUI's vae folders. {vae.VAE_FILE_HINT}"

    @classmethod
    def execute(cls, model, latent, vae_file=common.FROM_MODEL, **given) -> io.NodeOutput:
        report = common.begin_stage(cls.hidden.dynprompt)
        samples = latent.get("samples") if isinstance(latent, dict) else latent
        settings = vae.DecoderSettings(
            common.resolve(model),
            device=common.device(),
            vae_file=None if vae_file in (None, common.FROM_MODEL, LEGACY_FROM_MODEL) else vae_path(vae_file),
            **vae.INPUTS.settings_values(given),
        )
        with common.comfy_advice():
            images = vae.decode(settings, samples, report=report, on_progress=common.stage_progress())
        return io.NodeOutput(images)


def vae_files() -> list[str]:
    return folder_paths.get_filename_list("vae")


def vae_path(name: str) -> str:
    """The file ``name`` in ComfyUI's models/vae folders (extra_model_paths.yaml included)."""
    path = folder_paths.get_full_path("vae", name)
    if path is None:
        raise FileNotFoundError(
            f"vae_file {name!r} is not in ComfyUI's vae folders ({', '.join(folder_paths.get_folder_paths('vae'))})."
            f" {vae.VAE_FILE_HINT}"
        )
    return path
