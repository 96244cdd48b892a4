"""optimum-quanto: int8 or float8 weights, quantized after loading and frozen."""

from __future__ import annotations

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


class ScaledWeightLinear(torch.nn.Module):
    """A linear layer holding optimum-quanto's quantized weight as two plain tensors — ``weight_data``
    (int8 or float8, ``[out, in]``) and ``weight_scale`` (``[out, 1]``) — and expanding it to the input's
    dtype inside ``forward``. Under ``torch.compile`` the expansion fuses into one kernel per weight
    beside an ordinary fp16 matrix product, where quanto's tensor subclass stops the compiler; plain
    tensors also move and pin like any other (low-VRAM streaming)."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = data.shape[1], data.shape[0]
        self.register_buffer("weight_data", data)
        self.register_buffer("weight_scale", scale)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight_data.to(input.dtype) * self.weight_scale.to(input.dtype)
        return torch.nn.functional.linear(input, weight, self.bias)


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
                    f"{name}: a {type(weight).__name__} weight is not a per-row quantized one; the fast path "
                    "takes qint8 and qfloat8 weights."
                )
            setattr(parent, name, ScaledWeightLinear(weight._data, weight._scale, child.bias))
            replaced += 1
    return replaced
