"""optimum-quanto: int8 or float8 weights, quantized after loading and frozen."""

from __future__ import annotations

import torch

from .base import QuantBackend

# The final projection maps back to latent space; the recipe keeps it in full precision.
EXCLUDE = ("proj_out",)


class QuantoBackend(QuantBackend):
    name = "quanto"
    package = "optimum-quanto"
    module = "optimum.quanto"
    schemes = {
        "qint8": "int8 weights (the recipe's default)",
        "qfloat8": "float8 e4m3 weights",
    }
    device_types = frozenset({"cpu", "cuda"})

    def after_load(self, model: torch.nn.Module, scheme: str) -> torch.nn.Module:
        from optimum import quanto

        quanto.quantize(model, weights=getattr(quanto, scheme), exclude=list(EXCLUDE))
        quanto.freeze(model)
        return model

    def plain_modules(self, module: torch.nn.Module) -> int:
        return plain_linears(module)

    def describe(self, scheme: str) -> str:
        return f"quanto {scheme}"


def plain_linears(module: torch.nn.Module) -> int:
    """Replace every frozen ``QLinear`` under ``module`` by a ``torch.nn.Linear`` holding the same
    quantized weight and bias; return how many. Unhooked it computes what ``QLinear`` does (quanto's
    tensor handles ``F.linear``); hooked by ``streaming`` with ``expand`` it runs on the expanded weight,
    which ``QLinear`` would quantize again."""
    from optimum.quanto import QTensor
    from optimum.quanto.nn import QLinear

    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QLinear) and isinstance(child.weight, QTensor):
                with torch.device("meta"):
                    plain = torch.nn.Linear(
                        child.in_features, child.out_features, bias=child.bias is not None
                    )
                plain.weight = child.weight
                plain.bias = child.bias
                setattr(parent, name, plain)
                replaced += 1
    return replaced
