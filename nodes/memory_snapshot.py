from __future__ import annotations

from pathlib import Path

import folder_paths
import torch
from comfy_api.latest import io, ui

from ..core import timeline
from ..core.pool import cache
from . import common


class MemorySnapshot(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=common.SNAPSHOT_NODE_ID,
            display_name="Memory Snapshot",
            category=common.CATEGORY,
            description="Passes its input through, shows this prompt's memory timeline (allocated and reserved "
            "CUDA memory over time, each stage shaded, the peak labelled; per-stage figures without CUDA) and "
            "its per-stage table, and writes them to the output folder: the timeline .png, the table as .md "
            "and .json (peak allocated, peak reserved, seconds) and, with CUDA, the allocator snapshot "
            "(.pickle, open it at pytorch.org/memory_viz). With this node in a prompt the pack's nodes record "
            "the allocator history from their first stage.",
            inputs=[
                common.Anything.Input("value", tooltip="Anything; passed through unchanged."),
                io.String.Input(
                    "filename_prefix",
                    default="pixart_memory",
                    tooltip="File name prefix inside ComfyUI's output folder (letters, digits, _ - . only).",
                ),
            ],
            # The timeline comes after the pass-through, so links saved to output 0 stay valid.
            outputs=[
                common.Anything.Output(common.PASSED, display_name="value", tooltip="The input, unchanged."),
                io.Image.Output(
                    "timeline", display_name="timeline", tooltip="The memory timeline picture (as saved)."
                ),
            ],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, value, filename_prefix) -> io.NodeOutput:
        record = timeline.write_record(
            common.report(), Path(folder_paths.get_output_directory()), filename_prefix
        )
        image = torch.from_numpy(record.picture).float().div(255).unsqueeze(0)  # IMAGE [1, H, W, 3]
        summary = f"{record.summary}\n{cache.pool_summary()}; Free VRAM empties it"
        shown = {**ui.PreviewImage(image, cls=cls).as_dict(), **ui.PreviewText(summary).as_dict()}
        return io.NodeOutput(value, image, ui=shown)
