from __future__ import annotations

from pathlib import Path

import folder_paths
import torch
from comfy_api.latest import io, ui
from comfy_execution.utils import get_executing_context

from ..core import measure, timeline
from ..core.pool import cache
from . import comfy_models, common

TIMELINE_SLOT = 1  # the picture's output, after the pass-through
# The timeline output when no picture is drawn: a black IMAGE, [1, H, W, 3].
PLACEHOLDER_SIZE = 64


class MemorySnapshot(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=common.SNAPSHOT_NODE_ID,
            display_name="Memory Snapshot",
            category=common.CATEGORY,
            description="Passes its input through and shows this prompt's per-stage memory table (peak "
            "allocated, peak reserved, seconds), written to the output folder as .md and .json. With "
            "allocator_history on, the pack's nodes record the CUDA allocator history from the prompt's "
            "first stage, and the node draws the memory timeline (allocated and reserved CUDA memory over "
            "time, each stage shaded, the peak labelled) and writes it as .png with the allocator snapshot "
            "(.pickle, open it at pytorch.org/memory_viz). With it off the picture (per-stage bars) is drawn "
            "only when the timeline output is linked.",
            inputs=[
                common.Anything.Input("value", tooltip="Anything; passed through unchanged."),
                io.String.Input(
                    "filename_prefix",
                    default="pixart_memory",
                    tooltip="File name prefix inside ComfyUI's output folder (letters, digits, _ - . only).",
                ),
                # Last and optional, so workflows saved before it still load and API prompts still queue.
                io.Boolean.Input(
                    common.HISTORY_INPUT,
                    default=False,
                    optional=True,
                    tooltip="On: the pack's nodes record the CUDA allocator history from the prompt's first "
                    "stage, and this node draws the memory timeline from it and writes the allocator "
                    "snapshot (.pickle for pytorch.org/memory_viz). Recording slows every allocation a "
                    "little and drawing takes about a tenth of a second. Off: only the per-stage table "
                    "(peaks and seconds, .md and .json, shown here as text), which costs next to nothing.",
                ),
            ],
            # The timeline comes after the pass-through, so links saved to output 0 stay valid.
            outputs=[
                common.Anything.Output(common.PASSED, display_name="value", tooltip="The input, unchanged."),
                io.Image.Output(
                    "timeline",
                    display_name="timeline",
                    tooltip="The memory timeline picture (as saved); drawn when allocator_history is on or "
                    "this output is linked, else a small black image.",
                ),
            ],
            hidden=[io.Hidden.dynprompt, io.Hidden.unique_id],
            is_output_node=True,
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs) -> bool | None:
        # ComfyUI's cache key holds a node's inputs, not what takes its outputs: whether the timeline is
        # linked is part of it, so a link added later gets a picture rather than a cached placeholder.
        context = get_executing_context()
        prompt = comfy_models.running_prompt(context.prompt_id) if context is not None else None
        return None if prompt is None else common.output_linked(prompt, context.node_id, TIMELINE_SLOT)

    @classmethod
    def execute(cls, value, filename_prefix, allocator_history=False) -> io.NodeOutput:
        prompt, node_id = common.original_prompt(cls.hidden.dynprompt), cls.hidden.unique_id
        if not allocator_history and not common.history_asked(prompt, skip=node_id):
            # Recorded for a linked allocator_history that came out false: stop, keep nothing.
            measure.history.stop()
        picture = allocator_history or common.output_linked(prompt, node_id, TIMELINE_SLOT)
        record = timeline.write_record(
            common.report(),
            Path(folder_paths.get_output_directory()),
            filename_prefix,
            picture=picture,
            history=allocator_history,
        )
        summary = f"{record.summary}\n{cache.pool_summary()}; Free VRAM empties it"
        shown = ui.PreviewText(summary).as_dict()
        if record.picture is None:
            image = torch.zeros(1, PLACEHOLDER_SIZE, PLACEHOLDER_SIZE, 3)
        else:
            image = torch.from_numpy(record.picture).float().div(255).unsqueeze(0)  # IMAGE [1, H, W, 3]
            shown = {**ui.PreviewImage(image, cls=cls).as_dict(), **shown}
        return io.NodeOutput(value, image, ui=shown)
