from __future__ import annotations

import folder_paths
from comfy_api.latest import io, ui

from ..core import contract, resolutions, sampler, sampler_settings, schedulers
from . import comfy_models, common

# validate_inputs gets a linked input as None (its value is not known yet) and leaves out an optional
# input that is not linked.
_NOT_LINKED = object()
# validate_inputs' defaults for the optional inputs it names: their declared ones.
_DECLARED = {name: sampler_settings.INPUTS.field_default(name) for name in ("resolution", "denoise")}
# Where ComfyUI keeps single-file diffusion models: Load Diffusion Model's folder, then full checkpoints.
TRANSFORMER_FOLDERS = ("diffusion_models", "checkpoints")


def transformer_files() -> list[str]:
    """The safetensors files in models/diffusion_models and models/checkpoints (pickles are never offered)."""
    names = {
        name
        for folder in TRANSFORMER_FOLDERS
        for name in folder_paths.get_filename_list(folder)
        if name.lower().endswith(".safetensors")
    }
    return sorted(names, key=str.lower)


def transformer_path(name: str) -> str | None:
    if name == common.FROM_MODEL:
        return None
    for folder in TRANSFORMER_FOLDERS:
        path = folder_paths.get_full_path(folder, name)
        if path is not None:
            return path
    raise FileNotFoundError(
        f"transformer_file {name!r} is in neither models/diffusion_models nor models/checkpoints; put it there "
        f"or choose {common.FROM_MODEL!r}."
    )


def transformer_file_input() -> io.Combo.Input:
    return io.Combo.Input(
        "transformer_file",
        options=[common.FROM_MODEL, *transformer_files()],
        default=common.FROM_MODEL,
        optional=True,
        tooltip="(from model): the model folder's transformer/. Or a PixArt-Σ transformer as one "
        ".safetensors file from models/diffusion_models or models/checkpoints (the original checkpoint "
        "ComfyUI's Load Diffusion Model reads, e.g. PixArt-Sigma-XL-2-2K-MS, or a diffusers transformer "
        "file). A size in its name (512, 1024, 2K) sets its native size; the model folder still gives "
        "the scheduler and the VAE.",
    )


class QuantoPixArtSampler(comfy_models.HoldsModels, io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PixArtQ_Sampler",
            display_name="Quanto PixArt Sampler",
            category=common.CATEGORY,
            description="Loads the PixArt-Σ transformer with int8 (or float8) weights through optimum-quanto, "
            "samples latents from the embeddings with the chosen scheduler (DPM-Solver++ by default), from noise "
            "or from a LATENT (image-to-image), then unloads it. The LATENT is in raw VAE space like every "
            "ComfyUI sampler's, so core VAE Decode with the SDXL VAE reads it too.",
            inputs=common.node_inputs(
                sampler_settings.INPUTS,
                model=common.model_input(),
                embeds=common.PixArtEmbeds.Input(
                    "embeds", tooltip="From Quantized T5 Encode (same model family)."
                ),
                latent=io.Latent.Input(
                    "latent",
                    optional=True,
                    tooltip="Optional LATENT to start from (image-to-image), e.g. VAE Encode with the SDXL VAE "
                    "or Empty Latent Image. It sets the size (width, height and resolution are ignored) and the "
                    "batch: a single latent is repeated batch_size times, a batch of latents gives one image "
                    "each (batch_size 1).",
                ),
                transformer_file=transformer_file_input(),
                loras=common.PixArtLoras.Input(
                    "loras",
                    optional=True,
                    tooltip="LoRAs from PixArt-Σ LoRA nodes, added at run time to the int8 weights (no float "
                    "copy of the transformer); a kept transformer stays the one without them.",
                ),
            ),
            outputs=[
                io.Latent.Output(tooltip="Latents in raw VAE space (divided by the VAE scaling factor).")
            ],
            hidden=[io.Hidden.dynprompt],
        )

    @classmethod
    def validate_inputs(
        cls,
        width,
        height,
        resolution=_DECLARED["resolution"],
        denoise=_DECLARED["denoise"],
        latent=_NOT_LINKED,
    ) -> bool | str:
        # Refused when the prompt is queued, before T5 runs. ComfyUI does not enforce an INT's step, and
        # leaves its range and combo checks to this function for the inputs it names.
        has_latent = latent is not _NOT_LINKED
        native = resolution == resolutions.NATIVE_RESOLUTION  # the model's size, known once it is read
        try:
            if not native:
                width, height = resolutions.preset_size(resolution, width, height)
            sampler.check_denoise(denoise, has_latent)
            if not has_latent and not native:
                contract.check_size("width", width)
                contract.check_size("height", height)
        except (TypeError, ValueError) as exc:
            return str(exc)
        return True

    @classmethod
    def execute(
        cls, model, embeds, latent=None, transformer_file=common.FROM_MODEL, loras=(), **given
    ) -> io.NodeOutput:
        report = common.begin_stage(cls.hidden.dynprompt)
        chosen = sampler_settings.INPUTS.settings_values(given)
        if latent is not None:
            # A linked latent sets the size: the width, height and resolution widgets are not used then.
            chosen.update(width=None, height=None, resolution=resolutions.CUSTOM_RESOLUTION)
        settings = sampler_settings.SamplerSettings(
            common.resolve(model),
            device=common.device(),
            transformer_file=transformer_path(transformer_file),
            quant_cache=common.quant_cache_dir(),
            loras=loras,
            **chosen,
        )
        warnings: list[str] = []
        with common.comfy_advice():
            samples = sampler.sample(
                settings,
                embeds,
                init_latents=None if latent is None else latent["samples"],
                report=report,
                on_warning=warnings.append,
                on_progress=common.step_callback(schedulers.steps_to_run(settings.steps, settings.denoise)),
            )
        # Shown on the node: a size far from the model's own.
        shown = ui.PreviewText("\n".join(warnings)) if warnings else None
        return io.NodeOutput({"samples": samples}, ui=shown)
