"""The pack's int8 transformer as one of ComfyUI's own MODELs (the int8 Model Loader's output), a module
for each of its jobs:

- :mod:`.build`: the MODEL built by ComfyUI's own steps with the pack's 8-bit layers (:func:`load`);
- :mod:`.residence`: where its weights wait between runs (page-locked host copies in CPU memory);
- :mod:`.lora`: LoRA patches during a run, added to the weights each layer expands (an 8-bit layer's
  quantized again);
- :mod:`.forward`: its forward, diffusers' PixArt-Σ blocks over ComfyUI's own layers;
- :mod:`.guidance`: the prompt and the negative prompt in one batch at each step under ComfyUI's samplers
  (also set by the Batched Guidance node on any PixArt-Σ MODEL);
- :mod:`.repeatable`: the same image for the same prompt and seed under KSampler."""

from .build import load

__all__ = ["load"]
