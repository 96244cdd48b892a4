"""The sampling stage's choices: its inputs in its node's order (:data:`INPUTS`) and its settings
(:class:`SamplerSettings`), every choice checked when it is made, before anything loads. The sampler
(:mod:`.sampler`) runs them."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import estimates, inputs, lora, measure
from .contract import MAX_SIZE, MIN_SIZE, SIZE_MULTIPLE, check_size
from .estimates import Workload
from .models import ModelSource
from .quant import Scheme
from .quant import compute as compute_paths
from .resolutions import CUSTOM_RESOLUTION, NATIVE_RESOLUTION, preset_size, resolution_presets
from .schedulers import DEFAULT_SCHEDULER, SCHEDULERS
from .single_files import TransformerFile
from .transformer import INPUTS as TRANSFORMER_INPUTS
from .transformer import TransformerSettings

MAX_BATCH = 64
MAX_STEPS = 1000
MAX_CFG = 100.0
MAX_SEED = 2**64 - 1


def _size(name: str) -> inputs.Input:
    return inputs.Input(
        name,
        inputs.INT,
        1024,
        f"Image {name} in pixels, a multiple of {SIZE_MULTIPLE}. Used when resolution is custom and no latent "
        "is connected.",
        min=MIN_SIZE,
        max=MAX_SIZE,
        step=SIZE_MULTIPLE,
        unset=None,  # the model's own size
        checked=False,  # check_size(), once the size is worked out
        help=f"pixels, a multiple of {SIZE_MULTIPLE} in {MIN_SIZE}..{MAX_SIZE} (default: the model's size)",
    )


# The sampling stage's inputs in its node's order (see inputs.py).
INPUTS = inputs.Inputs(
    TRANSFORMER_INPUTS["model"],
    inputs.slot("embeds"),
    _size("width"),
    _size("height"),
    inputs.Input(
        "steps",
        inputs.INT,
        20,
        "Denoising steps of the schedule; from a latent with denoise below 1, only the last steps × denoise "
        "of them run.",
        min=1,
        max=MAX_STEPS,
        help="denoising steps",
    ),
    inputs.Input(
        "cfg",
        inputs.FLOAT,
        4.5,
        "Classifier-free guidance scale; 1 or less turns guidance off.",
        min=0.0,
        max=MAX_CFG,
        step=0.1,
        round=0.01,
        hint=" (1 or less turns guidance off)",
        help="classifier-free guidance scale",
    ),
    inputs.Input(
        "seed",
        inputs.INT,
        0,
        "Noise seed; noise is drawn on the CPU, so a seed gives the same image on any device.",
        min=0,
        max=MAX_SEED,
        control_after_generate=True,
        help="noise seed (same seed, same image on any device)",
    ),
    inputs.Input(
        "batch_size", inputs.INT, 1, "Images per prompt.", min=1, max=MAX_BATCH, help="images per prompt"
    ),
    # Named `weights` before; at the same place, so saved workflows keep their value. `--quant` is the
    # command line's name of earlier versions.
    TRANSFORMER_INPUTS["quantization"],
    inputs.KEEP_LOADED,
    # Optional and after the others, so workflows saved before they existed still load.
    inputs.slot("latent", optional=True),
    inputs.Input(
        "resolution",
        inputs.CHOICE,
        CUSTOM_RESOLUTION,
        "custom: width and height. native: a square of the model's own size (512, 1024 or 2048 px, from its "
        "transformer). Otherwise one of PixArt's aspect-ratio sizes for its 512, 1024 and 2048 px models, "
        "listed as width×height (width:height).",
        choices=lambda: [CUSTOM_RESOLUTION, NATIVE_RESOLUTION, *resolution_presets()],
        optional=True,
        checked=False,  # preset_size()
        metavar="{custom,native,PRESET}",
        help="custom: --width and --height (each the model's size when left out); native: a square of the "
        "model's size; or a preset such as '1024: 1024×1024 (1:1)'",
    ),
    inputs.Input(
        "scheduler",
        inputs.CHOICE,
        DEFAULT_SCHEDULER,
        "dpmsolver++: the model's own scheduler (DPM-Solver++ 2M). The others are built from its config; "
        "euler_ancestral and dpmsolver++_sde add seeded noise at every step.",
        choices=SCHEDULERS,
        optional=True,
        help="sampler",
    ),
    inputs.Input(
        "denoise",
        inputs.FLOAT,
        1.0,
        "With a latent: how much of it is redrawn. 1 starts from noise (the latent gives only size and "
        "batch), 0 returns it unchanged. Below 1 needs a latent.",
        min=0.0,
        max=1.0,
        step=0.01,
        optional=True,
        hint=" (1 starts from noise, 0 returns the latent as it is)",
        flags=(),  # the command line starts from no latent
    ),
    inputs.low_vram("the transformer's 28 blocks"),
    TRANSFORMER_INPUTS["transformer_file"],
    inputs.Input(
        "fast",
        inputs.BOOL,
        False,
        "Compile the transformer's blocks (torch.compile) and run them on weights expanded from qint8/qfloat8 "
        "to fp16 one block at a time: faster than fp16 at about the quantized model's memory. The first image "
        "of a session (and of each new size) waits for the compile, about 20 s on a GPU; keep_loaded keeps "
        "the compiled model. Needs a working torch.compile (Triton on NVIDIA GPUs). An 8-bit compute (auto's "
        "on H100/H200) compiles its blocks with or without fast.",
        optional=True,
        help="the fast sampler path: compiled blocks on weights expanded one block at a time (compiles first)",
    ),
    inputs.slot("loras", optional=True),
    inputs.Input(
        "step_cache",
        inputs.FLOAT,
        0.0,
        "Lossy, off at 0: reuse the transformer's work across steps (diffusers' First Block Cache). At each "
        "step the first block runs; when its output changed by less than this fraction since the last full "
        "step, the other blocks are skipped and their last change reused. Higher is faster and further from "
        "the uncached image; about 0.05–0.1 is a common range. The same seed still gives the same image.",
        min=0.0,
        max=1.0,
        step=0.01,
        round=0.001,
        optional=True,
        hint=" (0 turns it off)",
        help="lossy: skip the transformer's blocks 2.. on steps where the first block's output changed by less "
        "than this fraction (diffusers' First Block Cache; 0 = off)",
    ),
    TRANSFORMER_INPUTS["compute"],
)


@dataclass(frozen=True)
class SamplerSettings:
    """Every choice of the sampling stage, checked when it is made (before anything loads): what a node or
    the command line builds once and hands to :func:`.sampler.sample`. The transformer's own choices
    (``model``, ``transformer_file``, ``quantization``, ``compute``, ``precision``, ``device``,
    ``quant_cache``) are given here as the others are and make its
    :class:`~.transformer.TransformerSettings` (``transformer``), which works out what follows from them
    (``scheme``, ``dtype``, where the weights come from and their config); the size a ``resolution``
    stands for is worked out here, and nowhere else.

    ``resolution``: ``custom`` takes ``width`` and ``height`` (a side left None is the model's native size),
    ``native`` a square of the model's own size, otherwise one of :func:`.resolutions.resolution_presets`.
    A LATENT given to :func:`.sampler.sample` sets the size instead. ``denoise`` below 1 needs that latent
    (image-to-image).
    ``transformer_file`` (one safetensors file, original PixArt or diffusers layout) replaces ``model``'s
    transformer/; ``model`` still gives the scheduler and the VAE's scaling factor.
    The quantized layers compute what quanto's generic matrix product computes (the weight expanded, then
    an fp16 matrix product) as plain torch layers; on a GPU, and without ``low_vram``, they hold their weights
    expanded for the run (``dense``: about 1.2 GiB more at 1024², still below T5's peak, when the device has
    the room), so a run costs what the unquantized model's does while the int8 weights are what is kept,
    pooled and copied. ``low_vram`` holds the stage to :data:`estimates.LOW_VRAM_BUDGET`: the quantized
    transformer stays whole on the GPU for its run when it fits (the int8 model at 1024²), else it stays in
    CPU memory and its blocks stream to the GPU one at a time (:meth:`streamed`).
    ``fast`` runs the blocks compiled (``torch.compile``); the first image of a process, and of each new
    size, waits for the compile. ``keep_loaded`` keeps the transformer for the next prompt instead of
    unloading it. With
    ``quant_cache`` (a folder) the quantized transformer is saved there on first use and read back later
    (:mod:`quant_cache`), as T5 is. ``loras`` are added to the transformer's weights for the run
    (:mod:`lora`): the kept and pooled transformer stays the one without them. ``step_cache`` above 0 skips
    the blocks after the first on steps where the first block's output barely changed
    (:func:`.transformer_run._step_cache`; lossy)."""

    model: ModelSource
    width: int | None = INPUTS.field_default("width")
    height: int | None = INPUTS.field_default("height")
    resolution: str = INPUTS.field_default("resolution")
    steps: int = INPUTS.field_default("steps")
    cfg: float = INPUTS.field_default("cfg")
    seed: int = INPUTS.field_default("seed")
    batch_size: int = INPUTS.field_default("batch_size")
    scheduler: str = INPUTS.field_default("scheduler")
    denoise: float = INPUTS.field_default("denoise")
    quantization: str = INPUTS.field_default("quantization")
    device: torch.device | str | None = None
    precision: str | torch.dtype | None = None
    keep_loaded: bool = INPUTS.field_default("keep_loaded")
    low_vram: bool = INPUTS.field_default("low_vram")
    fast: bool = INPUTS.field_default("fast")
    step_cache: float = INPUTS.field_default("step_cache")
    compute: str = INPUTS.field_default("compute")
    transformer_file: str | os.PathLike | None = None
    quant_cache: str | os.PathLike | None = None
    loras: tuple[lora.LoraSpec, ...] = ()
    transformer: TransformerSettings = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # A size given for resolution custom is checked with the other inputs (one error names them all);
        # the sizes worked out from the model are checked below.
        given = [(n, v) for n, v in (("width", self.width), ("height", self.height)) if v is not None]
        sizes = given if self.resolution == CUSTOM_RESOLUTION else []
        INPUTS.check(self, *(functools.partial(check_size, name, value) for name, value in sizes))
        if self.quant_cache is not None:
            object.__setattr__(self, "quant_cache", Path(self.quant_cache))
        object.__setattr__(self, "loras", tuple(self.loras))
        for spec in self.loras:
            if not isinstance(spec, lora.LoraSpec):
                raise TypeError(f"loras holds {spec!r}; each must be a LoraSpec (a file and a strength).")
        transformer = TransformerSettings(
            self.model,
            transformer_file=self.transformer_file,
            quantization=self.quantization,
            compute=self.compute,
            precision=self.precision,
            device=self.device,
            quant_cache=self.quant_cache,
            also_reads=["scheduler"],
            # auto's 8-bit compute is measured without low_vram.
            eight_bit_auto=not self.low_vram,
        )
        native = transformer.native_size
        derived = {"transformer": transformer, "device": transformer.device}
        if self.resolution == NATIVE_RESOLUTION:
            derived["width"] = derived["height"] = native
        elif self.resolution == CUSTOM_RESOLUTION:
            derived["width"] = native if self.width is None else self.width
            derived["height"] = native if self.height is None else self.height
        else:
            derived["width"], derived["height"] = preset_size(self.resolution, self.width, self.height)
        check_size("width", derived["width"])
        check_size("height", derived["height"])
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    # What every stage's settings say (the stage contract), and what the sampling reads: the transformer's.
    @property
    def scheme(self) -> Scheme:
        return self.transformer.scheme

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def weights(self) -> ModelSource | TransformerFile:
        return self.transformer.weights

    @property
    def native_size(self) -> int:
        return self.transformer.native_size

    @property
    def caption_channels(self) -> int:
        return self.transformer.caption_channels

    @property
    def compiled(self) -> bool:
        """Whether the blocks run compiled: with ``fast``, or for the compute's sake
        (:attr:`.transformer.TransformerSettings.compiled`)."""
        return self.fast or self.transformer.compiled

    @property
    def dense(self) -> bool:
        """Whether a run holds the weights its quantized layers compute with
        (:attr:`.transformer.TransformerSettings.dense`, without low_vram): in fp16 compute, and in an 8-bit
        one for a LoRA (its layers' patched weights; without one the 8-bit run holds nothing)."""
        eight_bit = self.transformer.compute != compute_paths.FP16
        loras = any(spec.strength for spec in self.loras)
        return not self.low_vram and self.transformer.dense and (loras or not eight_bit)

    def streamed(self, work: Workload) -> bool:
        """Whether a run of ``work`` streams the blocks from CPU memory: with low_vram, when the whole
        transformer and its run would not fit in the low-VRAM budget."""
        if not self.low_vram:
            return False
        run = estimates.transformer(self.scheme, self.dtype, work.images, work.pixels)
        return sum(run) > estimates.LOW_VRAM_BUDGET

    def cache_key(self, work: Workload) -> tuple:
        """What a kept transformer is found by: the same weights, quantized and placed the same way."""
        return (
            "transformer",
            self.weights.key,
            self.scheme.name,
            self.dtype,
            str(self.device),
            self.low_vram,
            self.streamed(work),
            self.compiled,
            self.transformer.compute,
        )

    def device_bytes(self, work: Workload) -> tuple[int, int]:
        """(weights, work) bytes the stage holds on its device for a run of ``work``."""
        # The expanded copy of fp16 compute (an 8-bit layer holds a patched copy only with a LoRA, 1 byte a
        # weight, where the device has the room at the run: transformer_run._dense).
        expanded = self.dense and self.transformer.compute == compute_paths.FP16
        return estimates.transformer(
            self.scheme, self.dtype, work.images, work.pixels, self.streamed(work), expanded
        )

    def out_of_memory_advice(self) -> str:
        steps = (
            [] if self.low_vram else ["turn on low_vram (the transformer's blocks streamed from CPU memory)"]
        )
        steps.append("lower width, height or batch_size")
        if self.scheme.if_out_of_memory:
            steps.append(self.scheme.if_out_of_memory)
        return ", ".join([*steps, measure.FREE_OTHERS])
