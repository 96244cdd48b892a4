"""The interface every quantization backend implements."""

from __future__ import annotations

import importlib
import importlib.util
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch


class QuantBackend:
    """A library that quantizes weights. The schemes it runs, and what the pack knows of each, are in
    ``quant.TEXT_ENCODER_SCHEMES`` and ``quant.TRANSFORMER_SCHEMES``; a backend holds the mechanics.

    A scheme either acts at load time (``load_kwargs``, passed to ``from_pretrained``) or after it
    (``after_load``), whichever the library supports; a stage calls both. A backend that quantizes after
    loading may also save what it made and rebuild it without quantizing again (``saves_quantized``,
    ``save_quantized``, ``load_quantized``: the pre-quantized cache, :mod:`..quant_cache`).
    """

    name: str
    package: str  # what `pip install` takes
    module: str  # what Python imports
    device_types: frozenset[str]

    def require(self, scheme: str, device: torch.device) -> None:
        """Raise a clear error unless ``scheme`` can run on ``device`` with this machine's packages. Finds
        the package without importing it (a stage whose weights come pre-quantized may never need to)."""
        try:
            found = importlib.util.find_spec(self.module) is not None
        except ImportError as exc:  # its parent package is missing
            found, problem = False, f" ({exc})"
        else:
            problem = ""
        if not found:
            raise ImportError(
                f"quantization {scheme!r} needs the {self.package!r} package, which is not installed"
                f"{problem}. Install it with `pip install {self.package}`, or choose quantization 'none'."
            )
        if device.type not in self.device_types:
            raise RuntimeError(
                f"quantization {scheme!r} ({self.package}) cannot run on device {device.type!r}; it runs on "
                f"{', '.join(sorted(self.device_types))}. Choose quantization 'none' or another device."
            )

    def load_kwargs(self, scheme: str, compute_dtype: torch.dtype) -> dict[str, Any]:
        return {}

    def after_load(self, model: torch.nn.Module, scheme: str) -> torch.nn.Module:
        return model

    saves_quantized = False

    def save_quantized(self, model: torch.nn.Module, folder: Path) -> None:
        """Write ``model`` as ``after_load`` left it into ``folder`` (safetensors only)."""
        raise NotImplementedError(f"{self.name} does not save quantized models")

    def load_quantized(self, empty: torch.nn.Module, scheme: str, folder: Path) -> torch.nn.Module:
        """``empty`` (the model's architecture, its parameters on the meta device) holding what
        :meth:`save_quantized` wrote into ``folder``: the model ``after_load`` made, without quantizing."""
        raise NotImplementedError(f"{self.name} does not load quantized models")

    def plain_modules(self, module: torch.nn.Module) -> int:
        """Turn the library's quantized layers under ``module`` into plain torch layers that hold the
        quantized weights as plain tensors and expand them in ``forward`` (what the sampler runs: eager, or
        compiled on the fast path); return how many."""
        return 0

    def dense_weights(self, module: torch.nn.Module) -> AbstractContextManager[int]:
        """For the body, the plain layers under ``module`` hold their weights expanded to the compute dtype
        (:meth:`dense_bytes` more device memory) and skip the expansion per call; yields how many layers."""
        return nullcontext(0)

    def dense_bytes(self, module: torch.nn.Module) -> int:
        """Device bytes :meth:`dense_weights` adds for ``module``."""
        return 0

    def keeps_fp32_modules(self, scheme: str) -> bool:
        """Whether the layers a model marks ``_keep_in_fp32_modules`` stay unquantized (transformers'
        default, which guards against fp16 overflow)."""
        return True

    def describe(self, scheme: str) -> str:
        """A short label for reports and embeddings metadata."""
        return f"{self.name} {scheme}"


class NoQuant(QuantBackend):
    name = "none"
    package = "torch"
    module = "torch"
    device_types = frozenset({"cpu", "cuda", "mps", "xpu"})

    def describe(self, scheme: str) -> str:
        return "none"
