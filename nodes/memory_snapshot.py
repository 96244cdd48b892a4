from __future__ import annotations

from pathlib import Path

import folder_paths
from comfy_api.latest import io, ui

from ..core import memory
from . import common

_ANY = io.MatchType.Template("value")


class MemorySnapshot(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=common.SNAPSHOT_NODE_ID,
            display_name="Memory Snapshot",
            category=common.CATEGORY,
            description="Passes its input through and writes this prompt's memory record to the output folder: "
            "the CUDA allocator snapshot (.pickle, open it at pytorch.org/memory_viz) and a per-stage table "
            "(peak allocated, peak reserved, seconds) as .md and .json. With this node in a prompt the pack's "
            "nodes record the allocator history from their first stage.",
            inputs=[
                io.MatchType.Input("value", template=_ANY, tooltip="Anything; passed through unchanged."),
                io.String.Input(
                    "filename_prefix",
                    default="pixart_memory",
                    tooltip="File name prefix inside ComfyUI's output folder (letters, digits, _ - . only).",
                ),
            ],
            outputs=[
                io.MatchType.Output(template=_ANY, display_name="value", tooltip="The input, unchanged.")
            ],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, value, filename_prefix) -> io.NodeOutput:
        summary = memory.write_record(
            common.report(), Path(folder_paths.get_output_directory()), filename_prefix
        )
        return io.NodeOutput(value, ui=ui.PreviewText(summary))
