from __future__ import annotations

import folder_paths
from comfy_api.latest import io, ui

from ..core import contract, sampler, schedulers
from ..core.quant import TRANSFORMER_SCHEMES
from . import common, memory_manager

# validate_inputs gets a linked input as None (its value is not known yet) and leaves out an optional
# input that is not linked.
_NOT_LINKED = object()
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


def _size_input(name: str) -> io.Int.Input:
    return io.Int.Input(
        name,
        default=1024,
        min=contract.MIN_SIZE,
        max=contract.MAX_SIZE,
        step=contract.SIZE_MULTIPLE,
        tooltip=f"Image {name} in pixels, a multiple of {contract.SIZE_MULTIPLE}. Used when resolution is "
        f"custom and no latent is connected.",
    )


class QuantoPixArtSampler(memory_manager.HoldsModels, io.ComfyNode):
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
            inputs=[
                common.model_input(),
                common.PixArtEmbeds.Input("embeds", tooltip="From Quantized T5 Encode (same model family)."),
                *(_size_input(name) for name in ("width", "height")),
                io.Int.Input(
                    "steps",
                    default=20,
                    min=1,
                    max=sampler.MAX_STEPS,
                    tooltip="Denoising steps of the schedule; from a latent with denoise below 1, only the "
                    "last steps × denoise of them run.",
                ),
                io.Float.Input(
                    "cfg",
                    default=4.5,
                    min=0.0,
                    max=sampler.MAX_CFG,
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
                # Named `weights` before; at the same place, so saved workflows keep their value.
                common.quantization_input(TRANSFORMER_SCHEMES),
                common.keep_loaded_input(),
                # Optional and after the others, so workflows saved before they existed still load.
                io.Latent.Input(
                    "latent",
                    optional=True,
                    tooltip="Optional LATENT to start from (image-to-image), e.g. VAE Encode with the SDXL VAE "
                    "or Empty Latent Image. It sets the size (width, height and resolution are ignored) and the "
                    "batch: a single latent is repeated batch_size times, a batch of latents gives one image "
                    "each (batch_size 1).",
                ),
                io.Combo.Input(
                    "resolution",
                    options=[
                        sampler.CUSTOM_RESOLUTION,
                        sampler.NATIVE_RESOLUTION,
                        *sampler.resolution_presets(),
                    ],
                    default=sampler.CUSTOM_RESOLUTION,
                    optional=True,
                    tooltip="custom: width and height. native: a square of the model's own size (512, 1024 or "
                    "2048 px, from its transformer). Otherwise one of PixArt's aspect-ratio sizes for its 512, 1024 "
                    "and 2048 px models, listed as width×height (width:height).",
                ),
                io.Combo.Input(
                    "scheduler",
                    options=list(schedulers.SCHEDULERS),
                    default=schedulers.DEFAULT_SCHEDULER,
                    optional=True,
                    tooltip="dpmsolver++: the model's own scheduler (DPM-Solver++ 2M). The others are built from "
                    "its config; euler_ancestral and dpmsolver++_sde add seeded noise at every step.",
                ),
                io.Float.Input(
                    "denoise",
                    default=1.0,
                    min=0.0,
                    max=1.0,
                    step=0.01,
                    optional=True,
                    tooltip="With a latent: how much of it is redrawn. 1 starts from noise (the latent gives "
                    "only size and batch), 0 returns it unchanged. Below 1 needs a latent.",
                ),
                common.low_vram_input("the transformer's 28 blocks"),
                transformer_file_input(),
                io.Boolean.Input(
                    "fast",
                    default=False,
                    optional=True,
                    tooltip="Compile the transformer's blocks (torch.compile) and run them on weights expanded "
                    "from qint8/qfloat8 to fp16 one block at a time: faster than fp16 at about the quantized "
                    "model's memory. The first image of a session (and of each new size) waits for the compile, "
                    "about 20 s on a GPU; keep_loaded keeps the compiled model. Needs a working torch.compile "
                    "(Triton on NVIDIA GPUs).",
                ),
                common.PixArtLoras.Input(
                    "loras",
                    optional=True,
                    tooltip="LoRAs from PixArt-Σ LoRA nodes, added at run time to the int8 weights (no float "
                    "copy of the transformer); a kept transformer stays the one without them.",
                ),
            ],
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
        resolution=sampler.CUSTOM_RESOLUTION,
        denoise=1.0,
        latent=_NOT_LINKED,
    ) -> bool | str:
        # Refused when the prompt is queued, before T5 runs. ComfyUI does not enforce an INT's step, and
        # leaves its range and combo checks to this function for the inputs it names.
        has_latent = latent is not _NOT_LINKED
        native = resolution == sampler.NATIVE_RESOLUTION  # the model's size, known once it is read
        try:
            if not native:
                width, height = sampler.preset_size(resolution, width, height)
            sampler.check_denoise(denoise, has_latent)
            if not has_latent and not native:
                contract.check_size("width", width)
                contract.check_size("height", height)
        except (TypeError, ValueError) as exc:
            return str(exc)
        return True

    @classmethod
    def execute(
        cls,
        model,
        embeds,
        width,
        height,
        steps,
        cfg,
        seed,
        batch_size,
        quantization,
        keep_loaded,
        latent=None,
        resolution=sampler.CUSTOM_RESOLUTION,
        scheduler=schedulers.DEFAULT_SCHEDULER,
        denoise=1.0,
        low_vram=False,
        transformer_file=common.FROM_MODEL,
        fast=False,
        loras=(),
    ) -> io.NodeOutput:
        report = common.begin_stage(cls.hidden.dynprompt)
        # A linked latent sets the size: the width and height widgets are not used then.
        sized = latent is None
        settings = sampler.SamplerSettings(
            common.resolve(model),
            width=width if sized else None,
            height=height if sized else None,
            resolution=resolution if sized else sampler.CUSTOM_RESOLUTION,
            steps=steps,
            cfg=cfg,
            seed=seed,
            batch_size=batch_size,
            scheduler=scheduler,
            denoise=denoise,
            quantization=quantization,
            device=common.device(),
            keep_loaded=keep_loaded,
            low_vram=low_vram,
            fast=fast,
            transformer_file=transformer_path(transformer_file),
            quant_cache=common.quant_cache_dir(),
            loras=loras,
        )
        warnings: list[str] = []
        with common.comfy_advice():
            samples = sampler.sample(
                settings,
                embeds,
                init_latents=None if latent is None else latent["samples"],
                report=report,
                on_warning=warnings.append,
                on_progress=common.step_callback(schedulers.steps_to_run(steps, denoise)),
            )
        # Shown on the node: a size far from the model's own.
        shown = ui.PreviewText("\n".join(warnings)) if warnings else None
        return io.NodeOutput({"samples": samples}, ui=shown)
