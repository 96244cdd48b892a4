"""ComfyUI adapters: one file per node; each reads inputs, calls one core function, wraps the result.
Beside them: common.py (ComfyUI's services as plain values, node inputs from core's tables), comfy_models.py
(the stages' models as ComfyUI's models) and int8_model/ (the int8 Model Loader's MODEL)."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from .batched_guidance import PixArtBatchedGuidance
from .free_vram import FreeVRAM
from .lora_loader import PixArtLoRA
from .memory_snapshot import MemorySnapshot
from .model_loader import PixArtInt8ModelLoader
from .sampler import QuantoPixArtSampler
from .t5_encode import QuantizedT5Encode
from .vae_decode import PixArtVAEDecode

NODES: list[type[io.ComfyNode]] = [
    QuantizedT5Encode,
    QuantoPixArtSampler,
    PixArtVAEDecode,
    FreeVRAM,
    MemorySnapshot,
    PixArtInt8ModelLoader,
    PixArtLoRA,
    PixArtBatchedGuidance,
]


class PixArtLowVRAMExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return NODES
