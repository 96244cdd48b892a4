"""The Batched Guidance (PixArt-Σ) node: the prompt and the negative prompt of any PixArt-Σ MODEL run as one
batch at each step under ComfyUI's samplers (how: :mod:`.int8_model.guidance`)."""

from __future__ import annotations

import comfy.model_base
from comfy_api.latest import io

from . import common
from .int8_model import guidance


def is_pixart(patcher) -> bool:
    return isinstance(getattr(patcher, "model", None), comfy.model_base.PixArt)


class PixArtBatchedGuidance(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PixArtQ_BatchedGuidance",
            display_name="Batched Guidance (PixArt-Σ)",
            category=common.CATEGORY,
            description="Runs the prompt and the negative prompt of a PixArt-Σ MODEL in one forward per step "
            "under KSampler (and ComfyUI's other samplers), whatever their token lengths: both are repeated "
            "to a common length, as ComfyUI pads cross-attention for other models, which gives the two "
            "passes' result, and computes the noise schedule on the CPU wherever the model lies, so the same "
            "prompt and seed give the same image every time. For any PixArt-Σ MODEL, ComfyUI's own (Load Diffusion Model) included; the "
            "PixArt-Σ int8 Model Loader's MODEL has it already.",
            inputs=[io.Model.Input("model", tooltip="A PixArt-Σ MODEL.")],
            outputs=[io.Model.Output(tooltip="The same MODEL, batching its guidance.")],
        )

    @classmethod
    def execute(cls, model) -> io.NodeOutput:
        if not is_pixart(model):
            kind = type(getattr(model, "model", model)).__name__
            raise ValueError(
                f"model: Batched Guidance (PixArt-Σ) takes a PixArt-Σ MODEL, not a {kind}; connect it to "
                "a PixArt-Σ loader's MODEL."
            )
        if guidance.applied(model):
            return io.NodeOutput(model)
        patched = model.clone()
        guidance.apply(patched)
        return io.NodeOutput(patched)
