"""What every node of the pack shares: ComfyUI's services turned into plain values for core."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import comfy.latent_formats
import comfy.model_management
import comfy.utils
import folder_paths
import latent_preview
import torch
from comfy_api.latest import io
from comfy_execution.utils import get_executing_context

from ..core import inputs, measure, quant_cache
from ..core.models import HUB_IDS, ModelSource, find_model_folders, resolve_model
from ..core.pool import cache
from . import comfy_models

CATEGORY = "PixArt-Σ low VRAM"
SNAPSHOT_NODE_ID = "PixArtQ_MemorySnapshot"
# Memory Snapshot's input that asks the pack's nodes for the CUDA allocator history, read by begin_stage.
HISTORY_INPUT = "allocator_history"
# The choice of a single file input (t5_file, transformer_file, vae_file) that means the model's own folder.
FROM_MODEL = "(from model)"

PixArtEmbeds = io.Custom("PIXART_EMBEDS")
# LoRAs for the Quanto PixArt Sampler: a tuple of core.lora.LoraSpec, chained through PixArt-Σ LoRA nodes.
PixArtLoras = io.Custom("PIXART_LORAS")


class _AnyType(str):
    """ComfyUI's wildcard type, "*", equal to every type in ComfyUI's link checks: v0.8 and later accept "*"
    as it is, v0.3.64 only compares types with ``!=`` (its MatchType cannot be linked there)."""

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = str.__hash__


# The pass-through nodes' value (Free VRAM, Memory Snapshot): anything in, the same thing out.
Anything = io.Custom(_AnyType("*"))
# v0.3.64 wants an output's id to differ from every input's; the output is shown as "value".
PASSED = "passed"

# Kept models are entered in ComfyUI's memory manager, and each stage asks it for room before loading.
comfy_models.install(cache)


def model_roots() -> list[str]:
    """ComfyUI's models/diffusers folders, including those from extra_model_paths.yaml."""
    return folder_paths.get_folder_paths("diffusers")


def model_input() -> io.Combo.Input:
    return io.Combo.Input(
        "model",
        options=find_model_folders(model_roots()) + list(HUB_IDS),
        tooltip="A diffusers-format PixArt-Σ folder under models/diffusers (one with model_index.json), or "
        "the hub id, downloaded to the Hugging Face cache when the machine is online.",
    )


# What a declared input's tooltip adds in ComfyUI (core's tooltips speak of stages, not of ComfyUI).
COMFYUI_TOOLTIPS = {
    "keep_loaded": "It is one of ComfyUI's models while kept: ComfyUI moves it to CPU memory when it needs the "
    "GPU's room (another model's load, Unload Models) and the next prompt moves it back instead of loading it "
    "again; Free VRAM, Free model and node cache, or a prompt without the pack's nodes drops it.",
}
_WIDGETS = {
    inputs.INT: io.Int,
    inputs.FLOAT: io.Float,
    inputs.BOOL: io.Boolean,
    inputs.CHOICE: io.Combo,
    inputs.TEXT: io.String,
}


def widget(declared: inputs.Input) -> io.Input:
    """ComfyUI's input for a stage input core declares: its kind, default, range or options, tooltip and
    optional flag as declared."""
    tooltip = " ".join(filter(None, (declared.tooltip, COMFYUI_TOOLTIPS.get(declared.name))))
    given = {"default": declared.default, "optional": declared.optional, "tooltip": tooltip}
    if declared.kind == inputs.CHOICE:
        given["options"] = declared.options()
    if declared.multiline:
        given["multiline"] = True
    if declared.control_after_generate:
        given["control_after_generate"] = True
    for name in ("min", "max", "step", "round"):
        if getattr(declared, name) is not None:
            given[name] = getattr(declared, name)
    return _WIDGETS[declared.kind].Input(declared.name, **given)


def node_inputs(table: inputs.Inputs, **own: io.Input) -> list[io.Input]:
    """A node's inputs in its stage table's order: each declared input as :func:`widget` makes it, each slot
    the node's own input of that name (``own``: linked types, choices among ComfyUI's folders)."""
    made = []
    for declared in table:
        if declared.kind != inputs.SLOT:
            made.append(widget(declared))
            continue
        mine = own.pop(declared.name)
        if mine.id != declared.name or bool(mine.optional) != declared.optional:
            raise ValueError(
                f"the node's input {mine.id!r} does not fill the slot {declared.name!r} as declared"
            )
        made.append(mine)
    if own:
        raise ValueError(f"{', '.join(own)}: not slots of this node's inputs")
    return made


def quant_cache_dir() -> Path:
    """Pre-quantized weights: ``$PIXART_LOWVRAM_QUANT_CACHE``, else ``models/pixart_lowvram/quantized``."""
    return Path(
        os.environ.get(quant_cache.ENV) or Path(folder_paths.models_dir) / "pixart_lowvram" / "quantized"
    )


def resolve(name: str) -> ModelSource:
    return resolve_model(name, model_roots())


def device():
    return comfy.model_management.get_torch_device()


def run_id() -> str | None:
    context = get_executing_context()
    return context.prompt_id if context is not None else None


def report() -> measure.MemoryReport:
    """This prompt's memory report (a throwaway one outside a prompt)."""
    prompt_id = run_id()
    return measure.reports.get(prompt_id) if prompt_id is not None else measure.MemoryReport()


def original_prompt(dynprompt) -> dict:
    """The prompt as queued (API format: node id → class_type and inputs); empty without one."""
    return dynprompt.get_original_prompt() if dynprompt is not None else {}


def _is_link(value: object) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[1], int)


def history_asked(prompt: dict, skip: str | None = None) -> bool:
    """Whether a Memory Snapshot node of ``prompt`` (other than node ``skip``) asks for the allocator history:
    its ``allocator_history`` is true, or linked (a linked value is known only when the node runs, so it
    counts as asked)."""
    for node_id, node in prompt.items():
        if not isinstance(node, dict) or node.get("class_type") != SNAPSHOT_NODE_ID or str(node_id) == skip:
            continue
        value = node.get("inputs", {}).get(HISTORY_INPUT)
        if value is True or _is_link(value):
            return True
    return False


def output_linked(prompt: dict, node_id: str | None, slot: int) -> bool:
    """Whether a node of ``prompt`` takes output ``slot`` of node ``node_id``."""
    return node_id is not None and any(
        _is_link(value) and str(value[0]) == str(node_id) and value[1] == slot
        for node in prompt.values()
        if isinstance(node, dict)
        for value in node.get("inputs", {}).values()
    )


def begin_stage(dynprompt) -> measure.MemoryReport:
    """Called first by each model node: starts the allocator history when this prompt holds a Memory
    Snapshot node that asks for it (so the snapshot covers every stage), else stops one left running by an
    earlier prompt; returns this prompt's report."""
    if history_asked(original_prompt(dynprompt)):
        measure.history.ensure(run_id() or "no-prompt")
    else:
        measure.history.stop()
    return report()


@contextlib.contextmanager
def comfy_advice() -> Iterator[None]:
    """A stage's out-of-memory error, with how a ComfyUI user frees the memory other models hold."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        raise torch.cuda.OutOfMemoryError(
            f"{exc} In ComfyUI: put Free VRAM before this node, or unload models (POST /free)."
        ) from exc


def stage_progress():
    """ComfyUI's progress bar for a stage without steps (T5 Encode, VAE Decode): it moves when the model is
    loaded and when the stage is done, and a Cancel stops the stage at those points."""
    bars: list = []

    def on_progress(done: int, total: int, _latents=None) -> None:
        comfy.model_management.throw_exception_if_processing_interrupted()
        if not bars:
            bars.append(comfy.utils.ProgressBar(total))
        bars[0].update_absolute(done, total)

    return on_progress


def step_callback(total: int):
    """Drives ComfyUI's progress bar with a preview of each step, and stops at the next step when the user
    cancels.

    The preview is ComfyUI's own previewer for the SDXL latent format (the SDXL VAE is PixArt-Σ's), chosen
    by ``--preview-method`` or the prompt's override: TAESD-XL from models/vae_approx, latent-to-RGB, or
    none. It is decoded every step, as ComfyUI's samplers do."""
    bar = comfy.utils.ProgressBar(total)
    previewer = latent_preview.get_previewer(device(), comfy.latent_formats.SDXL())

    def on_step(step: int, _total: int, latents) -> None:
        comfy.model_management.throw_exception_if_processing_interrupted()
        preview = None
        if previewer is not None:
            # The pipeline's latents are raw VAE latents × the VAE's scaling factor (0.13025), which is the
            # SDXL format's process_in space that ComfyUI's previewers take. They preview the first image,
            # in float32 like ComfyUI's samplers' latents (TAESD's weights are float32).
            preview = previewer.decode_latent_to_preview_image("JPEG", latents[:1].float())
        bar.update_absolute(step, total, preview)

    return on_step
