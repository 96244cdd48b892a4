"""Quantization: every scheme of every stage and what the pack knows of it, in one table each.

A :class:`Scheme` is a stage's quantization choice: its name (the same in the nodes, the command line
and core), a one-line description (tooltips, ``--help``), the backend that runs it, the bytes it holds on
its device (the memory estimate the host is asked to make room for) and what to try instead when it
runs out of memory. Nodes, command line, estimates and messages read these tables; nothing else
restates a scheme's facts. Adding a scheme is one row here (and a backend, for a new library).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .base import NoQuant, QuantBackend
from .bitsandbytes import BitsAndBytesBackend
from .quanto import QuantoBackend

GIB = 2**30
BITSANDBYTES, QUANTO, NONE = BitsAndBytesBackend(), QuantoBackend(), NoQuant()


@dataclass(frozen=True)
class Scheme:
    """One quantization choice of one stage."""

    name: str
    backend: QuantBackend
    description: str
    # On the stage's device at 2-byte compute (bf16/fp16): T5 whole while it encodes; the transformer per
    # parameter. An unquantized scheme scales with the compute dtype.
    device_bytes: int
    # What to try with this scheme when its stage runs out of memory ("" for the smallest).
    if_out_of_memory: str = ""

    @property
    def quantized(self) -> bool:
        return self.backend is not NONE

    def bytes_at(self, dtype: torch.dtype) -> int:
        """``device_bytes`` for compute in ``dtype``."""
        return self.device_bytes if self.quantized else self.device_bytes * dtype.itemsize // 2

    def require(self, device: torch.device) -> None:
        """Raise a clear error unless this scheme runs on ``device`` with this machine's packages."""
        self.backend.require(self.name, device)

    def load_kwargs(self, compute_dtype: torch.dtype) -> dict[str, Any]:
        return self.backend.load_kwargs(self.name, compute_dtype)

    def after_load(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.backend.after_load(model, self.name)

    def plain_modules(self, module: torch.nn.Module) -> int:
        return self.backend.plain_modules(module)

    def dense_weights(self, module: torch.nn.Module):
        return self.backend.dense_weights(module)

    def dense_bytes(self, module: torch.nn.Module) -> int:
        return self.backend.dense_bytes(module)

    def keeps_fp32_modules(self) -> bool:
        return self.backend.keeps_fp32_modules(self.name)

    @property
    def saves_quantized(self) -> bool:
        """Whether what this scheme makes can be saved and read back without quantizing again (the
        pre-quantized cache, :mod:`..quant_cache`)."""
        return self.backend.saves_quantized

    def save_quantized(self, model: torch.nn.Module, folder: Path) -> None:
        """Write ``model``, as :meth:`after_load` left it, into ``folder``."""
        self.backend.save_quantized(model, folder)

    def load_quantized(self, empty: torch.nn.Module, folder: Path) -> torch.nn.Module:
        """``empty`` (the architecture on the meta device) holding what :meth:`save_quantized` wrote."""
        return self.backend.load_quantized(empty, self.name, folder)

    def describe(self) -> str:
        """A short label for reports and embeddings metadata, e.g. ``bitsandbytes nf4``."""
        return self.backend.describe(self.name)


_T5_NF4 = "set quantization to nf4 (T5-XXL in 2.7 GiB)"
# T5-XXL while it encodes, bf16 compute: nf4/fp4 2.62 GiB, nf4-recipe 4.01 GiB, bf16 9.01 GiB (measured
# by the retired stages benchmark: git log -p -- benchmarks/results/stages.json); int8 is not measured: about a byte per parameter (4.8 B) plus the bf16
# `wo` projections kept out of it (1.0 B parameters).
TEXT_ENCODER_SCHEMES: dict[str, Scheme] = {
    scheme.name: scheme
    for scheme in (
        Scheme(
            "nf4",
            BITSANDBYTES,
            "bitsandbytes 4-bit NormalFloat, double quantization, bf16 compute, every linear layer (smallest)",
            int(2.7 * GIB),
        ),
        Scheme(
            "nf4-recipe",
            BITSANDBYTES,
            "the notebook recipe's nf4: T5's wo projections left in bf16 (+1.4 GiB)",
            int(4.1 * GIB),
            _T5_NF4,
        ),
        Scheme(
            "fp4",
            BITSANDBYTES,
            "bitsandbytes 4-bit float, double quantization, every linear layer",
            int(2.7 * GIB),
        ),
        Scheme(
            "int8", BITSANDBYTES, "bitsandbytes 8-bit LLM.int8(), wo left in bf16", int(6.5 * GIB), _T5_NF4
        ),
        Scheme("none", NONE, "bf16 weights, unquantized (largest)", int(9.1 * GIB), _T5_NF4),
    )
}
# The transformer per parameter: qint8 and qfloat8 hold one byte each, fp16 two.
TRANSFORMER_SCHEMES: dict[str, Scheme] = {
    scheme.name: scheme
    for scheme in (
        Scheme("qint8", QUANTO, "optimum-quanto int8 weights, proj_out kept (the recipe's default)", 1),
        Scheme("qfloat8", QUANTO, "optimum-quanto float8 e4m3 weights", 1),
        Scheme(
            "none",
            NONE,
            "unquantized: fp16 on a GPU, bf16 on the CPU",
            2,
            "set quantization to qint8 (half the transformer's memory)",
        ),
    )
}


def choose(name: object, offered: dict[str, Scheme], device: torch.device) -> Scheme:
    """The scheme ``name`` of a stage that offers ``offered``, checked against this machine and ``device``."""
    scheme = offered.get(name) if isinstance(name, str) else None
    if scheme is None:
        raise ValueError(f"quantization {name!r} is not offered here; choose one of {', '.join(offered)}.")
    scheme.require(device)
    return scheme


def tooltip(offered: dict[str, Scheme]) -> str:
    """Every scheme of a stage with its description, for a node's tooltip or the command line's help."""
    return " ".join(f"{scheme.name}: {scheme.description}." for scheme in offered.values())


__all__ = [
    "TEXT_ENCODER_SCHEMES",
    "TRANSFORMER_SCHEMES",
    "QuantBackend",
    "Scheme",
    "choose",
    "tooltip",
]
