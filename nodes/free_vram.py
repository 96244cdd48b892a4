from __future__ import annotations

import time

import comfy.model_management
from comfy_api.latest import io, ui

from ..core.pool import free_all
from . import common


class FreeVRAM(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PixArtQ_FreeVRAM",
            display_name="Free VRAM",
            category=common.CATEGORY,
            description="Passes its input through unchanged after dropping the pack's kept models and the "
            "models ComfyUI holds, collecting garbage and emptying the CUDA cache. Place it between stages to "
            "force ordering and free memory.",
            inputs=[common.Anything.Input("value", tooltip="Anything; passed through unchanged.")],
            outputs=[
                common.Anything.Output(common.PASSED, display_name="value", tooltip="The input, unchanged.")
            ],
            is_output_node=True,
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs) -> float:
        # Freeing is the point: run on every queue, even when the input is cached (nodes after it re-run too).
        return time.time()

    @classmethod
    def execute(cls, value) -> io.NodeOutput:
        result = free_all(release_others=comfy.model_management.unload_all_models)
        comfy.model_management.soft_empty_cache()
        return io.NodeOutput(value, ui=ui.PreviewText(result.summary()))
