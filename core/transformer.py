"""The PixArt-Σ transformer in CPU memory, quantized: its settings (:class:`TransformerSettings`: where its
weights come from, its model folder or one safetensors file, how they are quantized and computed, in which
dtype on which device), its weights read in that dtype, quantized by their scheme or read back from the
pre-quantized cache. The sampler (:mod:`.sampler`) runs it; the pack's int8 MODEL
(``nodes/int8_model/build.py``) holds it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field
from pathlib import Path

import torch

from . import inputs, quant_cache
from .devices import as_device, resolve_dtype
from .models import ModelSource, check_weights
from .quant import TRANSFORMER_SCHEMES, Scheme, choose
from .quant import compute as compute_paths
from .single_files import TransformerFile, read_transformer_file

# The transformer's inputs in its nodes' order: the int8 Model Loader's, and the sampler's among its own.
INPUTS = inputs.Inputs(
    inputs.slot("model"),
    inputs.quantization(
        TRANSFORMER_SCHEMES, "the transformer's weights.", flags=("--quantization", "--quant")
    ),
    inputs.slot("transformer_file", optional=True),
    inputs.Input(
        "compute",
        inputs.CHOICE,
        compute_paths.AUTO,
        f"How the transformer's blocks compute. {compute_paths.tooltip()} The 8-bit paths hold no expanded "
        "weights (the sampler's peak about 1 GiB lower at 1024²; a LoRA's layers hold an 8-bit copy) and give "
        "an image close to fp16's, not equal to it (which card takes which: docs/USAGE.md, 8-bit compute).",
        choices=list(compute_paths.COMPUTES),
        optional=True,
        checked=False,  # compute_paths.require(), against the device and the quantization
        help=f"how the blocks compute: {compute_paths.tooltip()}",
    ),
)
# The int8 Model Loader's: the transformer's inputs; last (added later), whether ComfyUI keeps the MODEL on
# the GPU between runs, which the node declares itself.
LOADER_INPUTS = inputs.Inputs(*INPUTS, inputs.slot("keep_loaded", optional=True))


@dataclass(frozen=True)
class TransformerSettings:
    """Every choice about the transformer itself, checked when it is made (before anything loads): what the
    sampler's settings hold (:attr:`.sampler_settings.SamplerSettings.transformer`) and the int8 Model
    Loader builds. Derived values (``scheme``, ``dtype``, where the weights come from and their config) are
    worked out here and nowhere else.

    ``transformer_file`` (one safetensors file, original PixArt or diffusers layout) replaces ``model``'s
    transformer/. ``quantization`` names the scheme of :data:`~.quant.TRANSFORMER_SCHEMES`, ``compute`` how
    the blocks' quantized layers compute (:mod:`.quant.compute`; ``auto`` resolved here, once:
    :func:`.quant.compute.resolve`, the card's measured 8-bit path where ``eight_bit_auto`` lets it),
    ``precision`` the compute dtype (fp16 on a
    GPU, bf16 on the CPU when None). With ``quant_cache`` (a folder) the quantized transformer is saved there
    on first use and read back later (:mod:`quant_cache`). ``also_reads``: other parts of ``model`` the
    caller reads (the sampler's scheduler/), checked with the transformer's so that one error names every
    missing part."""

    model: ModelSource
    transformer_file: str | os.PathLike | None = None
    quantization: str = INPUTS.field_default("quantization")
    compute: str = INPUTS.field_default("compute")
    precision: str | torch.dtype | None = None
    device: torch.device | str | None = None
    quant_cache: str | os.PathLike | None = None
    also_reads: InitVar[Sequence[str]] = ()
    # Whether auto may take the card's measured 8-bit path: the int8 MODEL's, and the sampler's without
    # low_vram (unmeasured there).
    eight_bit_auto: InitVar[bool] = False
    scheme: Scheme = field(init=False)
    dtype: torch.dtype = field(init=False)
    weights: ModelSource | TransformerFile = field(init=False)
    config: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self, also_reads: Sequence[str], eight_bit_auto: bool) -> None:
        INPUTS.check(self)
        if self.quant_cache is not None:
            object.__setattr__(self, "quant_cache", Path(self.quant_cache))
        device = as_device(self.device)
        # The parts of the model read, there and readable before anything loads.
        self.model.check_complete([*also_reads, *(["transformer"] if self.transformer_file is None else [])])
        weights = transformer_weights(self.model, self.transformer_file)
        derived = {
            "device": device,
            "scheme": choose(self.quantization, TRANSFORMER_SCHEMES, device),
            "dtype": resolve_dtype(
                self.precision, device, cuda_default=torch.float16, cpu_default=torch.bfloat16
            ),
            "weights": weights,
            "config": weights.config
            if isinstance(weights, TransformerFile)
            else self.model.config("transformer"),
        }
        derived["compute"] = compute_paths.resolve(
            self.compute, device, self.quantization, eight_bit=eight_bit_auto
        )
        compute_paths.require(derived["compute"], device, self.quantization)
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def native_size(self) -> int:
        """The side in pixels the transformer was trained at (512, 1024 or 2048 for PixArt-Σ's variants)."""
        return self.weights.native_size

    @property
    def caption_channels(self) -> int:
        return self.config.get("caption_channels", 4096)

    @property
    def compiled(self) -> bool:
        """Whether the blocks run compiled for the compute's sake: the 8-bit paths on a GPU (their
        activations' quantization pays only fused into the kernel before it, :mod:`.quant.compute`; on the CPU
        a compile takes minutes and the 8-bit paths run eager). The sampler's ``fast`` compiles them too."""
        return self.compute != compute_paths.FP16 and self.device.type == "cuda"

    @property
    def dense(self) -> bool:
        """Whether a run of the whole transformer may hold the weights its quantized layers compute with (on
        a GPU, when quantized): expanded in fp16 compute, and an 8-bit layer's patched weight quantized again
        (:func:`.quant.quanto.dense_weights`); the sampler's ``low_vram`` runs without."""
        return self.device.type == "cuda" and self.scheme.quantized


def transformer_weights(
    source: ModelSource, transformer_file: str | os.PathLike | None = None
) -> ModelSource | TransformerFile:
    """Where the transformer comes from: ``source``'s transformer/ folder, or ``transformer_file`` (one
    safetensors file) whose config fills what its weights do not say from ``source``'s transformer config
    where ``source`` has one."""
    if transformer_file is None:
        return source
    try:
        folder_config = source.config("transformer")
    except FileNotFoundError:
        folder_config = {}
    return read_transformer_file(transformer_file, folder_config)


def _from_file(weights: TransformerFile, dtype: torch.dtype):
    """A transformer built empty from the file's inferred config, then given the file's weights (renamed
    to diffusers' keys): diffusers has no single-file loader for PixArt."""
    model = empty(weights.config)
    # The weights in ``dtype``; the position embedding buffer stays float32, as from_pretrained keeps it.
    model.load_state_dict({key: value.to(dtype) for key, value in weights.state_dict().items()}, assign=True)
    return model


def quantized_transformer(settings: TransformerSettings):
    """The transformer in CPU memory, quantized by the settings' scheme with its quantized layers plain ones
    (``plain_modules``), in eval mode without gradients: what the sampler runs and the pack's MODEL holds.
    With ``settings.quant_cache`` a scheme whose backend saves its work is quantized once and read back from
    there afterwards (:mod:`quant_cache`)."""
    weights, scheme = settings.weights, settings.scheme
    if isinstance(weights, TransformerFile):
        origin = weights.path
    else:
        origin = check_weights(weights.folder(["transformer"]) / "transformer", weights.name)

    def quantize():
        return scheme.after_load(read(settings, origin))

    if settings.quant_cache is None or not scheme.saves_quantized:
        model = quantize()
    else:
        recipe = {"scheme": scheme.name, "dtype": settings.dtype, "class": "PixArtTransformer2DModel"}
        if isinstance(weights, TransformerFile):
            recipe["config"] = weights.config  # inferred, so a change in the inference is a new entry
        model = quant_cache.load_or_build(
            quant_cache.entry(settings.quant_cache, "transformer", origin, recipe),
            load=lambda folder: scheme.load_quantized(empty(settings.config), folder),
            build=quantize,
            save=scheme.save_quantized,
        )
    model.eval().requires_grad_(False)
    scheme.plain_modules(model)
    return model


def read(settings: TransformerSettings, origin: Path):
    """The transformer's weights as they are on disk (``origin``: its file, or its checked folder), in the
    settings' dtype, on the CPU."""
    from diffusers import PixArtTransformer2DModel

    if isinstance(settings.weights, TransformerFile):
        return _from_file(settings.weights, settings.dtype)
    return PixArtTransformer2DModel.from_pretrained(origin, dtype=settings.dtype, use_safetensors=True)


def empty(config: dict):
    """The transformer's architecture with its parameters on the meta device (its buffers, such as the
    float32 position embedding, made as from_pretrained makes them)."""
    from accelerate import init_empty_weights
    from diffusers import PixArtTransformer2DModel

    with init_empty_weights():
        return PixArtTransformer2DModel.from_config(config)
