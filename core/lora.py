"""LoRAs on the PixArt-Σ transformer, applied at run time over its int8 weights.

A LoRA file holds, for some of the transformer's layers, two low-rank factors ``up`` ``[out, rank]`` and
``down`` ``[rank, in]`` (and optionally an ``alpha``): the layer's weight becomes
``W + strength × alpha / rank × up @ down``. The quantized layers keep their int8 weights as they are; the
sum is formed from the weight each layer expands anyway (:class:`~.quant.quanto.ScaledWeightLinear`'s
``weight_patch``), per call or once per run where the sampler holds the weights expanded; a layer computing
in 8 bits quantizes the sum again to its 8 bits (:meth:`~.quant.quanto.ScaledWeightLinear.requantized`, held
for the run where the sampler holds weights) — so no float copy of the transformer is ever kept, and the
model a prompt leaves in the pool is the one without LoRAs. An unquantized layer (``proj_out``, or every
layer with quantization ``none``) gets the same sum through torch's parametrizations, undone after the run.

Keys are read as ComfyUI reads PixArt LoRAs (``comfy/lora.py``): a diffusers module name of the transformer
behind ``transformer.``, ``base_model.model.`` or ``unet.base_model.model.``, with ``lora_A``/``lora_B``
(PEFT, diffusers) or ``lora_down``/``lora_up`` factors, and ``alpha`` beside them where the file has one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.utils import parametrize

from .contract import WarningCallback, warn
from .quant.quanto import ScaledWeightConv2d, ScaledWeightLinear, clear_run_patches

logger = logging.getLogger(__name__)

PREFIXES = ("unet.base_model.model.", "base_model.model.", "transformer.")
# (up, down) suffixes of one layer's factors.
FACTORS = ((".lora_B.weight", ".lora_A.weight"), (".lora_up.weight", ".lora_down.weight"))
MAX_STRENGTH = 10.0


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA file and the strength it is applied at (0 leaves it out)."""

    path: Path
    strength: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if not isinstance(self.strength, (int, float)) or not -MAX_STRENGTH <= self.strength <= MAX_STRENGTH:
            raise ValueError(
                f"LoRA strength {self.strength!r} for {self.path.name} is out of range; use a number from "
                f"{-MAX_STRENGTH} to {MAX_STRENGTH} (1 applies it as trained, 0 leaves it out)."
            )
        if self.path.suffix.lower() != ".safetensors":
            raise ValueError(
                f"LoRA {str(self.path)!r} is not a .safetensors file; LoRAs are read from safetensors files "
                "only (pickled .pt/.ckpt files can run code when read)."
            )
        if not self.path.is_file():
            raise FileNotFoundError(
                f"LoRA {str(self.path)!r} does not exist; give the path of a PixArt-Σ LoRA .safetensors file."
            )
        check_file(self.path)

    @classmethod
    def parse(cls, text: str) -> LoraSpec:
        """``FILE`` or ``FILE:STRENGTH`` (the command line's ``--lora``). Text after the last colon that is
        not a number is a bad strength, whatever the file is called, unless the whole text names a file
        (a colon in a file name, a Windows drive)."""
        path, sep, strength = str(text).rpartition(":")
        if sep and path and _is_number(strength):
            return cls(Path(path), float(strength))
        if sep and path and not Path(text).is_file():
            raise ValueError(
                f"--lora {text!r}: the strength {strength!r} is not a number; give FILE or FILE:STRENGTH, e.g. "
                f"{path}:0.8."
            )
        return cls(Path(text))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Factors:
    """One layer's LoRA factors from one file, in CPU memory, and the scale they are added at."""

    up: torch.Tensor
    down: torch.Tensor
    scale: float

    def delta(self, like: torch.Tensor) -> torch.Tensor:
        """``scale × up @ down`` shaped, placed and typed as ``like`` (a linear or convolution weight)."""
        up = self.up.to(like.device, torch.float32).flatten(1)
        down = self.down.to(like.device, torch.float32).flatten(1)
        return (self.scale * (up @ down)).reshape(like.shape).to(like.dtype)


def check_file(path: Path) -> None:
    """Refuse a file that is not a LoRA the pack reads, from its header alone (no tensor is read): every
    LoraSpec is checked so when it is made, before any model loads (the command line's ``--lora``, the
    LoRA node's input)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as file:
            keys = set(file.keys())
    except (SafetensorError, OSError) as exc:
        raise ValueError(
            f"LoRA {path.name} is not a readable safetensors file ({exc}); it is damaged or partly downloaded: "
            "download it again."
        ) from exc
    if not any(_pairs(keys)):
        raise ValueError(_no_layers(path, len(keys)))


def _pairs(keys: set[str]) -> Iterator[tuple[str, str, str]]:
    """(stem, up key, down key) of each layer whose two factors are both in ``keys``."""
    for key in sorted(keys):
        for up_suffix, down_suffix in FACTORS:
            stem = key[: -len(up_suffix)]
            if key.endswith(up_suffix) and stem + down_suffix in keys:
                yield stem, key, stem + down_suffix


def _no_layers(path: Path, tensors: int) -> str:
    return (
        f"LoRA {path.name} holds no LoRA layers (no lora_A/lora_B or lora_down/lora_up pairs among its "
        f"{tensors} tensors); it is not a LoRA file, or one of a format the pack does not read."
    )


def read(spec: LoraSpec) -> dict[str, Factors]:
    """The layers of ``spec``'s file, by diffusers module name of the transformer, at its strength."""
    from safetensors import safe_open

    with safe_open(spec.path, framework="pt") as file:
        keys = set(file.keys())
        layers: dict[str, Factors] = {}
        for stem, up_key, down_key in _pairs(keys):
            up, down = file.get_tensor(up_key), file.get_tensor(down_key)
            rank = down.shape[0]
            alpha = file.get_tensor(stem + ".alpha").item() if stem + ".alpha" in keys else rank
            layers[_module_name(stem)] = Factors(up, down, spec.strength * alpha / rank)
    if not layers:  # the file changed since its LoraSpec was made
        raise ValueError(_no_layers(spec.path, len(keys)))
    return layers


def _module_name(stem: str) -> str:
    for prefix in PREFIXES:
        if stem.startswith(prefix):
            return stem[len(prefix) :]
    return stem


class _Sum:
    """A weight plus the LoRA deltas of its layer: a quantized layer's ``weight_patch``."""

    def __init__(self, factors: list[Factors]):
        self.factors = factors

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        for factors in self.factors:
            weight = weight + factors.delta(weight)
        return weight


class _Parametrization(torch.nn.Module):
    """The same sum as a parametrization of an unquantized layer's weight (torch wants a module)."""

    def __init__(self, patch: _Sum):
        super().__init__()
        self.patch = patch

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return self.patch(weight)


@contextmanager
def applied(
    model: torch.nn.Module,
    specs: Sequence[LoraSpec],
    on_warning: WarningCallback | None = None,
) -> Iterator[int]:
    """For the body, ``model``'s layers compute with the LoRAs of ``specs`` added (stacked in order);
    afterwards the model is as it was. A LoRA of strength 0 is left out unread. A file whose layers match
    none of the model's, or only some, is named in a warning with how many matched. Yields how many layers
    carry a LoRA."""
    layers = dict(model.named_modules())
    patched: dict[str, list[Factors]] = {}
    for spec in specs:
        if spec.strength == 0:
            continue
        read_layers = read(spec)
        matched = [name for name in read_layers if _patchable(layers.get(name))]
        for name in matched:
            patched.setdefault(name, []).append(read_layers[name])
        warn(
            logger,
            mismatch_warning(spec.path.name, len(matched), sorted(set(read_layers) - set(matched))),
            on_warning,
        )
    try:
        for name, factors in patched.items():
            _attach(layers[name], _Sum(factors))
        if patched:
            logger.info("LoRA: %d layers of the transformer carry %d LoRA(s)", len(patched), len(specs))
        yield len(patched)
    finally:
        for name in patched:
            _detach(layers[name])


def mismatch_warning(file: str, matched: int, unmatched: Sequence[str]) -> str | None:
    """The warning for a LoRA of which only ``matched`` layers fit the model (None when all did)."""
    if not unmatched:
        return None
    total = matched + len(unmatched)
    shown = ", ".join(unmatched[:3]) + (", …" if len(unmatched) > 3 else "")
    if matched == 0:
        return (
            f"LoRA {file}: none of its {total} layers match the PixArt-Σ transformer ({shown}); it is left out. "
            "It is probably a LoRA of another model."
        )
    return (
        f"LoRA {file}: {matched} of its {total} layers match the PixArt-Σ transformer; the other "
        f"{len(unmatched)} ({shown}) are left out."
    )


def _patchable(layer: torch.nn.Module | None) -> bool:
    return isinstance(layer, (ScaledWeightLinear, ScaledWeightConv2d, torch.nn.Linear, torch.nn.Conv2d))


def _attach(layer: torch.nn.Module, patch: _Sum) -> None:
    if isinstance(layer, (ScaledWeightLinear, ScaledWeightConv2d)):
        layer.weight_patch = patch
    else:
        parametrize.register_parametrization(layer, "weight", _Parametrization(patch), unsafe=True)


def _detach(layer: torch.nn.Module) -> None:
    if isinstance(layer, (ScaledWeightLinear, ScaledWeightConv2d)):
        clear_run_patches(layer)
    elif parametrize.is_parametrized(layer, "weight"):
        parametrize.remove_parametrizations(layer, "weight", leave_parametrized=False)
