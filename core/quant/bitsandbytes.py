"""bitsandbytes: 4-bit (NF4, FP4) and 8-bit weights, applied while the model loads."""

from __future__ import annotations

import logging
from typing import Any

import torch

from .base import QuantBackend


class BitsAndBytesBackend(QuantBackend):
    name = "bitsandbytes"
    package = "bitsandbytes"
    module = "bitsandbytes"
    # bitsandbytes has native kernels for these; on the CPU its packed 4-bit path needs layer widths
    # divisible by 64, which every published T5 has.
    device_types = frozenset({"cpu", "cuda", "xpu"})
    # NVIDIA compute capability bitsandbytes' kernels need: 4-bit from Pascal, LLM.int8() from Turing.
    MIN_CAPABILITY = {"nf4": (6, 0), "nf4-recipe": (6, 0), "fp4": (6, 0), "int8": (7, 5)}

    def require(self, scheme: str, device: torch.device) -> None:
        super().require(scheme, device)
        if device.type == "cuda" and torch.version.cuda and torch.cuda.is_available():
            check_capability(
                scheme, torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device)
            )

    def load_kwargs(self, scheme: str, compute_dtype: torch.dtype) -> dict[str, Any]:
        from transformers import BitsAndBytesConfig

        if scheme == "int8":
            config = BitsAndBytesConfig(load_in_8bit=True)
        else:
            config = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type=scheme.removesuffix("-recipe"),
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=compute_dtype,
            )
        return {"quantization_config": config}

    def keeps_fp32_modules(self, scheme: str) -> bool:
        # 4-bit layers compute in the stage's dtype (bf16 has fp32's range), so nothing needs guarding;
        # LLM.int8() casts activations to fp16, where T5's wo can overflow.
        return scheme in ("nf4-recipe", "int8")


def check_capability(scheme: str, capability: tuple[int, int], gpu: str) -> None:
    needed = BitsAndBytesBackend.MIN_CAPABILITY[scheme]
    if tuple(capability) < needed:
        fallback = "nf4" if tuple(capability) >= BitsAndBytesBackend.MIN_CAPABILITY["nf4"] else "none"
        raise RuntimeError(
            f"quantization {scheme!r} needs an NVIDIA GPU of compute capability {needed[0]}.{needed[1]} or newer "
            f"(bitsandbytes); {gpu} has {capability[0]}.{capability[1]}. Choose quantization {fallback!r} instead."
        )


# On CPUs with AVX512-BF16, importing bitsandbytes looks for an optional faster 4-bit CPU kernel in the
# `kernels` package (which fetches it from the Hugging Face hub) and logs a warning that reads like an
# error when it is absent; bitsandbytes then uses its own kernel, which is what the pack measures and tests.
_OPTIONAL_KERNEL_LOGGER = "bitsandbytes.backends.cpu.ops"
_OPTIONAL_KERNEL_MESSAGE = "Failed to load CPU gemm_4bit_forward"


def _not_the_optional_kernel_notice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_OPTIONAL_KERNEL_MESSAGE)


def quiet_optional_kernel_notice() -> None:
    """Drop that one notice from bitsandbytes' log (nothing else); the front doors (the command line, the
    node pack's entry point) call this once, before anything imports bitsandbytes."""
    logging.getLogger(_OPTIONAL_KERNEL_LOGGER).addFilter(_not_the_optional_kernel_notice)
