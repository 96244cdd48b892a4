"""optimum-quanto: int8 or float8 weights, quantized after loading and frozen, run as plain torch layers.

quanto quantizes (``after_load``) and its state dict is what the pre-quantized cache holds; the layers that
run are plain ones holding quanto's values and scales (:func:`plain_layers`), and a model read back from the
cache is built as those directly, so a process whose cache is warm never imports quanto (nor the
``torch._dynamo`` machinery quanto's import brings)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from . import compute as compute_paths
from .base import QuantBackend

# The final projection maps back to latent space; the recipe keeps it in full precision.
EXCLUDE = ("proj_out",)
WEIGHTS_FILE = "quanto.safetensors"
# A frozen quanto weight in its state dict: its values and per-output-row scales; and the activation scales
# quanto's layers keep (1 without quantized activations).
DATA, SCALE = ".weight._data", ".weight._scale"
UNIT_SCALES = (".input_scale", ".output_scale")
# An 8-bit layer's attributes holding its patched weight quantized again for a run (:func:`hold_dense`).
PATCHED = ("patched_weight", "patched_scale")
# Takes a layer's expanded weight (a tensor of its own, free to change in place) and returns the one to
# compute with.
WeightPatch = Callable[[torch.Tensor], torch.Tensor]


class QuantoBackend(QuantBackend):
    name = "quanto"
    package = "optimum-quanto"
    module = "optimum.quanto"
    device_types = frozenset({"cpu", "cuda"})

    def after_load(self, model: torch.nn.Module, scheme: str) -> torch.nn.Module:
        from optimum import quanto

        quanto.quantize(model, weights=getattr(quanto, scheme), exclude=list(EXCLUDE))
        quanto.freeze(model)
        return model

    saves_quantized = True

    def save_quantized(self, model: torch.nn.Module, folder: Path) -> None:
        # quanto's own state dict: each quantized weight as plain ``weight._data`` (int8 or float8) and
        # ``weight._scale`` tensors beside the model's other parameters, in their own dtypes.
        from safetensors.torch import save_file

        state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
        save_file(state, Path(folder) / WEIGHTS_FILE)

    def load_quantized(self, empty: torch.nn.Module, scheme: str, folder: Path) -> torch.nn.Module:
        """The model :meth:`save_quantized` wrote, its quantized layers made as the plain layers
        :func:`plain_layers` makes of quanto's (the same tensors: quanto keeps a frozen weight's ``_data``
        and ``_scale`` as they are on the CPU), the rest filled from the file into ``empty``'s meta
        parameters. Not quanto's ``requantize`` (its ``to_empty`` leaves non-persistent buffers such as
        PatchEmbed's ``pos_embed`` uninitialised), and not quanto at all.

        Every tensor is copied out of the file's mapping into memory of its own (int8 data read in place
        from a safetensors file crashed quanto's CPU kernel once; copies are what the pool pins and moves)."""
        from safetensors import safe_open

        path = Path(folder) / WEIGHTS_FILE
        with safe_open(path, framework="pt") as file:
            state = {name: file.get_tensor(name).clone() for name in file.keys()}  # noqa: SIM118
        made = []
        for name in [key.removesuffix(DATA) for key in state if key.endswith(DATA)]:
            data, scale, bias = (
                state.pop(name + DATA),
                state.pop(name + SCALE),
                state.pop(name + ".bias", None),
            )
            for unit in UNIT_SCALES:  # quanto's activation scales: 1, activations are not quantized
                value = state.pop(name + unit, None)
                if value is not None and not bool((value == 1).all()):
                    raise ValueError(
                        f"{path}: {name}{unit} is not 1; quantized activations are not run here."
                    )
            parent, _, child = name.rpartition(".")
            owner = empty.get_submodule(parent)
            setattr(owner, child, plain_layer(getattr(owner, child), data, scale, bias))
            made.append(name)
        result = empty.load_state_dict(state, strict=False, assign=True)
        made_keys = {f"{name}.{key}" for name in made for key in ("weight", "weight_scale", "bias")}
        missing = sorted(set(result.missing_keys) - made_keys)
        if missing or result.unexpected_keys:
            raise ValueError(
                f"{path} does not fit the model: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
            )
        return empty

    def plain_modules(self, module: torch.nn.Module) -> int:
        return plain_layers(module)

    def dense_weights(self, module: torch.nn.Module):
        return dense_weights(module)

    def dense_bytes(self, module: torch.nn.Module) -> int:
        return dense_bytes(module)


def expand(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A quantized weight in the compute dtype, as quanto's ``qbytes_mm`` makes it (float8 promoted first)."""
    if data.dtype.is_floating_point:
        data = data.to(scale.dtype)
    return scale * data


def clear_run_patches(layer: torch.nn.Module) -> None:
    """A run's LoRA patch taken off ``layer``, with the patched weight it held: back to the class's defaults
    (none), not instance values equal to them. A compiled block guards on which attributes a layer holds,
    and would otherwise compile again for every run after one with a LoRA, into a graph that rounds
    differently."""
    for name in ("weight_patch", *PATCHED):
        vars(layer).pop(name, None)


class ScaledWeightLinear(torch.nn.Module):
    """A linear layer holding optimum-quanto's quantized weight as two plain tensors — ``weight`` (int8 or
    float8, ``[out, in]``) and ``weight_scale`` (``[out, 1]``, the compute dtype) — and computing what
    quanto's generic matrix product (``qbytes_mm``) computes: the weight expanded as quanto expands it
    (``scale × data``), then one matrix product, here with the bias fused into it (quanto adds it after:
    the same up to the rounding of that sum; a layer without bias gives that product's numbers bit for
    bit). On CUDA quanto may pick packed kernels of its own for some weights: the same arithmetic to
    rounding. Without quanto's tensor-subclass dispatch (about 0.1 ms of Python a layer and call: a third of
    the sampler's time at 1024²). Under ``torch.compile`` the expansion fuses into one kernel per weight;
    plain tensors also move and pin like any other (low-VRAM streaming, host copies).

    ``weight_patch``, when set, takes the expanded weight and returns the one to compute with: how LoRAs
    apply at run time (:mod:`..lora`, and ComfyUI's patches in the pack's MODEL), while the stored weight
    stays int8. ``weight_dense``, set by :func:`dense_weights` for a run, holds the expanded (and patched)
    weight so the layer skips the expansion; None otherwise (a non-persistent buffer: never saved, and a
    graph input when compiled). The same class is the pack's ComfyUI MODEL's linear layer.

    A layer computing in 8 bits (:attr:`compute`) with a ``weight_patch`` computes with its patched weight
    quantized again per row to its 8 bits (:meth:`requantized`): the same 8-bit product as without the
    patch, on other values. :func:`dense_weights` holds those values for a run (``patched_weight``,
    ``patched_scale``), made once; without them each call makes them."""

    weight_patch: WeightPatch | None = None
    # How the layer computes (:mod:`.compute`; :func:`set_compute`).
    compute: str = compute_paths.FP16
    # An 8-bit layer's patched weight quantized again, held for a run (:func:`hold_dense`): its values (as
    # :func:`.compute.weight_for` gives them) and per-row float32 scales ``[out, 1]``.
    patched_weight: torch.Tensor | None = None
    patched_scale: torch.Tensor | None = None

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = data.shape[1], data.shape[0]
        self.register_buffer("weight", data)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_dense", None, persistent=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def expanded(self, device: torch.device | None = None) -> torch.Tensor:
        """The weight to compute with on ``device`` (where it is, by default): expanded, then patched when a
        patch is set; an 8-bit layer's the values its 8-bit products take, expanded (:meth:`eight_bit_weight`:
        a call of few rows computes with the same weight as the others)."""
        if self.compute == compute_paths.FP16:
            return _expanded(self, device)
        values, scales = self.eight_bit_weight(device)
        return expand(values, scales.to(self.weight_scale.dtype))

    def requantized(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored weight expanded and patched, quantized per row to the layer's 8 bits on ``device``: its
        values and float32 scales ``[out, 1]``."""
        rows = compute_paths.quantize_float32(
            _expanded(self, device).float(), self.compute, (self.out_features,)
        )
        return rows.values, rows.scales

    def eight_bit_weight(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The values and per-row scales the layer's 8-bit products take on ``device``: the stored ones, or
        with a patch the patched weight quantized again (held for the run, or made now)."""
        if self.patched_weight is not None:
            return _on(self.patched_weight, device), _on(self.patched_scale, device)
        if self.weight_patch is not None:
            return self.requantized(device)
        return _on(self.weight, device), _on(self.weight_scale, device)

    def eight_bit(self, rows: int) -> bool:
        """Whether a call of ``rows`` rows computes an 8-bit product."""
        return self.compute != compute_paths.FP16 and rows > compute_paths.MIN_ROWS

    def takes_rows(self, rows: int) -> bool:
        """Whether a call of ``rows`` rows takes its input quantized per row (:meth:`product`), so an input
        quantized ahead serves it: every 8-bit call, LoRAs included (they are in the product's weight)."""
        return self.eight_bit(rows)

    def product(self, rows: compute_paths.Rows, dtype: torch.dtype) -> torch.Tensor:
        """The layer's 8-bit product of an input quantized per row, in ``dtype`` (:meth:`eight_bit_weight`:
        with its LoRAs in the weight)."""
        device = rows.values.device
        weight, scale = self.eight_bit_weight(device)
        return compute_paths.product(self.compute, rows, weight, scale, _on(self.bias, device), dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.eight_bit(input.numel() // self.in_features):
            return self.product(compute_paths.quantize_rows(input, self.compute), input.dtype)
        weight = self.weight_dense
        if weight is None or weight.device != input.device:
            weight = self.expanded(input.device)
        return torch.nn.functional.linear(input.to(weight.dtype), weight, _on(self.bias, input.device))


class ScaledWeightConv2d(torch.nn.Module):
    """A 2-D convolution holding quanto's quantized weight as plain ``weight`` and ``weight_scale``
    (``[out, 1, 1, 1]``) and convolving with the weight expanded as quanto expands it (quanto's QConv2d
    convolves with its dequantized weight: the same numbers), patched as :class:`ScaledWeightLinear`'s is.
    The transformer has one (the patch embedding), run once per step: it is never held expanded."""

    weight_patch: WeightPatch | None = None

    def __init__(
        self,
        data: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
    ):
        super().__init__()
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        self.register_buffer("weight", data)
        self.register_buffer("weight_scale", scale)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def like(
        cls, layer: torch.nn.Conv2d, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> ScaledWeightConv2d:
        if layer.padding_mode != "zeros":
            raise TypeError(f"a {layer.padding_mode!r}-padded convolution is not one the sampler runs")
        return cls(data, scale, bias, layer.stride, layer.padding, layer.dilation, layer.groups)

    def expanded(self, device: torch.device | None = None) -> torch.Tensor:
        return _expanded(self, device)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.expanded(input.device)
        return torch.nn.functional.conv2d(
            input.to(weight.dtype),
            weight,
            _on(self.bias, input.device),
            self.stride,
            self.padding,
            self.dilation,
            self.groups,
        )


def _expanded(layer: ScaledWeightLinear | ScaledWeightConv2d, device: torch.device | None) -> torch.Tensor:
    # A layer whose tensors are elsewhere (ComfyUI may leave layers of a partly loaded MODEL in host memory)
    # expands on the device that computes; where they already are, ``to`` is no copy.
    weight = expand(_on(layer.weight, device), _on(layer.weight_scale, device))
    return weight if layer.weight_patch is None else layer.weight_patch(weight)


def _on(tensor: torch.Tensor | None, device: torch.device | None) -> torch.Tensor | None:
    if tensor is None or device is None or tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=True)


def plain_layer(
    layer: torch.nn.Module, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.nn.Module:
    """The plain layer for ``layer`` (a Linear or Conv2d, quanto's or torch's) holding ``data`` and
    ``scale``, a per-output-row quantized weight (qint8, qfloat8)."""
    if scale.dim() != data.dim() or scale.shape[0] != data.shape[0] or scale[0].numel() != 1:
        raise TypeError(
            f"a weight scaled {tuple(scale.shape)} for values {tuple(data.shape)} is not a per-row quantized "
            "one; the sampler takes qint8 and qfloat8 weights."
        )
    if isinstance(layer, torch.nn.Conv2d):
        return ScaledWeightConv2d.like(layer, data, scale, bias)
    if isinstance(layer, torch.nn.Linear):
        return ScaledWeightLinear(data, scale, bias)
    raise TypeError(f"a quantized {type(layer).__name__} is not a layer the sampler runs")


def linear_layers(module: torch.nn.Module) -> list[ScaledWeightLinear]:
    return [layer for layer in module.modules() if isinstance(layer, ScaledWeightLinear)]


def dense_layers(module: torch.nn.Module) -> list[ScaledWeightLinear]:
    """The quantized linear layers under ``module`` that expand their weights (an 8-bit layer never does)."""
    return [layer for layer in linear_layers(module) if layer.compute == compute_paths.FP16]


def patched_layers(module: torch.nn.Module) -> list[ScaledWeightLinear]:
    """The quantized linear layers under ``module`` computing in 8 bits with a ``weight_patch``."""
    return [
        layer
        for layer in linear_layers(module)
        if layer.compute != compute_paths.FP16 and layer.weight_patch is not None
    ]


def dense_bytes(module: torch.nn.Module) -> int:
    """Bytes the weights :func:`dense_weights` holds for ``module``'s quantized layers take: the expanded
    ones, and the 8-bit layers' patched values with their scales."""
    expanded = sum(
        layer.out_features * layer.in_features * layer.weight_scale.element_size()
        for layer in dense_layers(module)
    )
    return expanded + sum(layer.out_features * (layer.in_features + 4) for layer in patched_layers(module))


@contextmanager
def dense_weights(module: torch.nn.Module) -> Iterator[int]:
    """For the body, every quantized layer under ``module`` holds the weight it computes with on its device
    (:func:`dense_bytes` more memory): expanded to the compute dtype, so a run costs what an unquantized
    model's costs, or, on an 8-bit layer with a patch, patched and quantized again, made once for the run
    instead of at every call. The same numbers bit for bit, since each is made as a call makes it.
    Afterwards they are dropped: the quantized weights stay what is kept, pooled and copied. Yields how many
    layers."""
    try:
        yield hold_dense(module)
    finally:
        drop_dense(module)


def hold_dense(module: torch.nn.Module, device: torch.device | None = None) -> int:
    """Every quantized linear layer under ``module`` holds the weight it computes with on ``device`` (where
    it is, by default) until :func:`drop_dense`: expanded (and patched), or an 8-bit layer's patched weight
    quantized again (:meth:`ScaledWeightLinear.requantized`); returns how many."""
    layers = dense_layers(module)
    for layer in layers:
        layer.weight_dense = layer.expanded(device)
    patched = patched_layers(module)
    for layer in patched:
        layer.patched_weight, layer.patched_scale = layer.requantized(device)
    return len(layers) + len(patched)


def drop_dense(module: torch.nn.Module) -> None:
    for layer in linear_layers(module):
        layer.weight_dense = None
        for name in PATCHED:
            vars(layer).pop(name, None)


def set_compute(module: torch.nn.Module, compute: str) -> int:
    """Every quantized linear layer under ``module`` computes by ``compute`` (:mod:`.compute`), its stored
    values made what that path takes (e4m3 for fp8: the layer cannot go back to int8 values); returns how
    many. ``fp16`` leaves the layers as they are."""
    if compute == compute_paths.FP16:
        return 0
    layers = linear_layers(module)
    for layer in layers:
        layer.weight = compute_paths.weight_for(compute, layer.weight)
        layer.compute = compute
    return len(layers)


def plain_layers(module: torch.nn.Module) -> int:
    """Replace every frozen quanto layer under ``module`` (``QLinear``, ``QConv2d`` with qint8 or qfloat8
    weights) by the plain layer holding the same quantized values and scales (:func:`plain_layer`); return
    how many. Without quanto imported there is none to replace (and quanto is not imported to look)."""
    if "optimum.quanto" not in sys.modules:
        return 0
    from optimum.quanto import WeightQBytesTensor
    from optimum.quanto.nn import QModuleMixin

    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, QModuleMixin):
                continue
            weight = child.weight
            if not isinstance(weight, WeightQBytesTensor):
                raise TypeError(
                    f"{name}: a {type(weight).__name__} weight is not a per-row quantized one; the sampler "
                    "takes qint8 and qfloat8 weights."
                )
            setattr(parent, name, plain_layer(child, weight._data, weight._scale, child.bias))
            replaced += 1
    return replaced
