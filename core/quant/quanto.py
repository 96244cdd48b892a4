"""optimum-quanto: int8 or float8 weights, quantized after loading and frozen."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from .base import QuantBackend

# The final projection maps back to latent space; the recipe keeps it in full precision.
EXCLUDE = ("proj_out",)
WEIGHTS_FILE = "quanto.safetensors"


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
        """quanto's layers put in place on the meta device, then filled from the file (quanto's own
        ``_load_from_state_dict`` makes each quantized weight from its ``_data`` and ``_scale``).

        Not quanto's ``requantize``: it calls ``to_empty``, which leaves non-persistent buffers
        (PatchEmbed's ``pos_embed``) uninitialised. Every tensor is copied out of the file's mapping into
        memory of its own: on the CPU, quanto's int8 kernel (``_weight_int8pack_mm``) crashes the process
        on int8 data read in place from a safetensors file."""
        from optimum import quanto
        from safetensors import safe_open

        quanto.quantize(empty, weights=getattr(quanto, scheme), exclude=list(EXCLUDE))
        with safe_open(Path(folder) / WEIGHTS_FILE, framework="pt") as file:
            state = {name: file.get_tensor(name).clone() for name in file.keys()}  # noqa: SIM118
        empty.load_state_dict(state, strict=True, assign=True)
        quanto.freeze(empty)
        return empty

    def plain_modules(self, module: torch.nn.Module) -> int:
        return plain_linears(module)

    def dense_weights(self, module: torch.nn.Module):
        return dense_weights(module)

    def dense_bytes(self, module: torch.nn.Module) -> int:
        return dense_bytes(module)


class ScaledWeightLinear(torch.nn.Module):
    """A linear layer holding optimum-quanto's quantized weight as two plain tensors — ``weight_data``
    (int8 or float8, ``[out, in]``) and ``weight_scale`` (``[out, 1]``, the compute dtype) — and computing
    what quanto's generic matrix product (``qbytes_mm``) computes: the weight expanded as quanto expands it
    (``scale × data``), then one matrix product, here with the bias fused into it (quanto adds it after:
    the same up to the rounding of that sum; a layer without bias gives that product's numbers bit for
    bit). On CUDA quanto may pick packed kernels of its own for some weights: the same arithmetic to
    rounding. Without quanto's tensor-subclass dispatch (about 0.1 ms of Python a layer and call: a third of
    the sampler's time at 1024²). Under ``torch.compile`` the expansion fuses into one kernel per weight;
    plain tensors also move and pin like any other (low-VRAM streaming, host copies).

    ``weight_dense``, set by :func:`dense_weights` for a run, holds the expanded weight so the layer skips
    the expansion; None otherwise (a non-persistent buffer: never saved, and a graph input when compiled)."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = data.shape[1], data.shape[0]
        self.register_buffer("weight_data", data)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_dense", None, persistent=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def expanded(self) -> torch.Tensor:
        """The weight in the compute dtype, as quanto's ``qbytes_mm`` makes it (float8 promoted first)."""
        data = self.weight_data
        if data.dtype.is_floating_point:
            data = data.to(self.weight_scale.dtype)
        return self.weight_scale * data

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight_dense if self.weight_dense is not None else self.expanded()
        return torch.nn.functional.linear(input.to(weight.dtype), weight, self.bias)


def dense_layers(module: torch.nn.Module) -> list[ScaledWeightLinear]:
    return [layer for layer in module.modules() if isinstance(layer, ScaledWeightLinear)]


def dense_bytes(module: torch.nn.Module) -> int:
    """Bytes the expanded weights of ``module``'s quantized layers take (see :func:`dense_weights`)."""
    return sum(
        layer.out_features * layer.in_features * layer.weight_scale.element_size()
        for layer in dense_layers(module)
    )


@contextmanager
def dense_weights(module: torch.nn.Module) -> Iterator[int]:
    """For the body, every quantized layer under ``module`` holds its weight expanded to the compute dtype
    on its device (:func:`dense_bytes` more memory), so a run costs what an unquantized model's costs; the
    same numbers bit for bit, since each layer expands the same way per call. Afterwards the expanded
    weights are dropped: the quantized ones stay what is kept, pooled and copied. Yields how many layers."""
    layers = dense_layers(module)
    try:
        for layer in layers:
            layer.weight_dense = layer.expanded()
        yield len(layers)
    finally:
        for layer in layers:
            layer.weight_dense = None


def plain_linears(module: torch.nn.Module) -> int:
    """Replace every frozen per-row ``QLinear`` under ``module`` (qint8, qfloat8 weights) by a
    :class:`ScaledWeightLinear` holding the same quantized values and scales; return how many."""
    from optimum.quanto import WeightQBytesTensor
    from optimum.quanto.nn import QLinear

    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, QLinear):
                continue
            weight = child.weight
            if not isinstance(weight, WeightQBytesTensor) or weight._scale.shape != (weight.shape[0], 1):
                raise TypeError(
                    f"{name}: a {type(weight).__name__} weight is not a per-row quantized one; the sampler "
                    "takes qint8 and qfloat8 weights."
                )
            setattr(parent, name, ScaledWeightLinear(weight._data, weight._scale, child.bias))
            replaced += 1
    return replaced
