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

    def describe(self, scheme: str) -> str:
        return f"quanto {scheme}"
