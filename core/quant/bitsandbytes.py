"""bitsandbytes: 4-bit (NF4, FP4) and 8-bit weights, applied while the model loads."""

from __future__ import annotations

from typing import Any

import torch

from .base import QuantBackend


class BitsAndBytesBackend(QuantBackend):
    name = "bitsandbytes"
    package = "bitsandbytes"
    module = "bitsandbytes"
    schemes = {
        "nf4": "4-bit NormalFloat, double quantization",
        "fp4": "4-bit float, double quantization",
        "int8": "8-bit LLM.int8()",
    }
    # bitsandbytes has native kernels for these; on the CPU its packed 4-bit path needs layer widths
    # divisible by 64, which every published T5 has.
    device_types = frozenset({"cpu", "cuda", "xpu"})

    def load_kwargs(self, scheme: str, compute_dtype: torch.dtype) -> dict[str, Any]:
        from transformers import BitsAndBytesConfig

        if scheme == "int8":
            config = BitsAndBytesConfig(load_in_8bit=True)
        else:
            config = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type=scheme,
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=compute_dtype,
            )
        return {"quantization_config": config}

    def describe(self, scheme: str) -> str:
        return f"bitsandbytes {scheme}"
