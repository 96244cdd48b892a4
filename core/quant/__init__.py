"""Quantization behind one interface: a registry from scheme name to backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .base import NoQuant, QuantBackend
from .bitsandbytes import BitsAndBytesBackend
from .quanto import QuantoBackend

BACKENDS: dict[str, QuantBackend] = {b.name: b for b in (NoQuant(), BitsAndBytesBackend(), QuantoBackend())}

# What each stage offers, in the order the nodes list them (the first is the default).
TEXT_ENCODER_SCHEMES = ("nf4", "nf4-recipe", "fp4", "int8", "none")
TRANSFORMER_SCHEMES = ("qint8", "qfloat8", "none")


def backend_for(scheme: str) -> QuantBackend:
    for backend in BACKENDS.values():
        if scheme in backend.schemes:
            return backend
    known = sorted({s for b in BACKENDS.values() for s in b.schemes})
    raise ValueError(f"unknown quantization {scheme!r}; known: {', '.join(known)}.")


@dataclass(frozen=True)
class Quantization:
    """A scheme checked against the stage that uses it, the packages and the device on creation."""

    scheme: str
    device: torch.device
    offered: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.scheme not in self.offered:
            raise ValueError(
                f"quantization {self.scheme!r} is not offered here; choose one of {self.offered}."
            )
        self.backend.require(self.scheme, self.device)

    @property
    def backend(self) -> QuantBackend:
        return backend_for(self.scheme)

    @property
    def enabled(self) -> bool:
        return self.scheme != "none"

    def load_kwargs(self, compute_dtype: torch.dtype) -> dict[str, Any]:
        return self.backend.load_kwargs(self.scheme, compute_dtype)

    def after_load(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.backend.after_load(model, self.scheme)

    def plain_modules(self, module: torch.nn.Module) -> int:
        return self.backend.plain_modules(module)

    def keeps_fp32_modules(self) -> bool:
        return self.backend.keeps_fp32_modules(self.scheme)

    def describe(self) -> str:
        return self.backend.describe(self.scheme)


__all__ = [
    "BACKENDS",
    "TEXT_ENCODER_SCHEMES",
    "TRANSFORMER_SCHEMES",
    "QuantBackend",
    "Quantization",
    "backend_for",
]
