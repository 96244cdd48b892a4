"""Run inside ComfyUI's Python (argv: ComfyUI path, a JSON job, an output file): what ComfyUI core's own
PixArt code makes, for tests/test_comfyui_core_interop.py.

- ``t5``: core's PixArt text encoder classes (tokenizer, T5 with PixArt's empty-negative rule) on a T5
  file, for each prompt: the CONDITIONING tensor. CLIPLoader itself builds only a full-size T5-XXL
  (4.8 B parameters); this builds the same classes with the file's small config.
- ``model``: the transformer file loaded as Load Diffusion Model loads it; its prediction for the given
  latents, timestep and conditioning, and what core detected."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(comfyui: str, job_path: str, out_path: str) -> None:
    sys.path.insert(0, comfyui)
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import comfy.sd
    import comfy.sd1_clip
    import comfy.text_encoders.pixart_t5 as pixart_t5
    import comfy.text_encoders.t5
    import torch
    from safetensors.torch import load_file, save_file

    job = json.loads(Path(job_path).read_text())
    out, info = {}, {}
    if "t5_file" in job:

        class T5(pixart_t5.T5XXLModel):  # core's PixArt T5 (its negative rule) with the file's config
            def __init__(self, device="cpu", dtype=None, model_options=None):
                comfy.sd1_clip.SDClipModel.__init__(
                    self, device=device, textmodel_json_config=os.path.abspath(job["t5_config"]), dtype=dtype,
                    special_tokens={"end": 1, "pad": 0}, model_class=comfy.text_encoders.t5.T5,
                    model_options={"model_name": "t5xxl"},
                )  # fmt: skip

        class Encoder(comfy.sd1_clip.SD1ClipModel):
            def __init__(self, device="cpu", dtype=None, model_options=None):
                super().__init__(device=device, dtype=torch.float32, name="t5xxl", clip_model=T5)

        target = type("Target", (), {"clip": Encoder, "tokenizer": pixart_t5.PixArtTokenizer, "params": {}})
        clip = comfy.sd.CLIP(target, model_options={})
        clip.load_sd(load_file(job["t5_file"]))
        for index, text in enumerate(job["prompts"]):
            ((cond, options),) = clip.encode_from_tokens_scheduled(clip.tokenize(text))
            out[f"t5.{index}"] = cond.contiguous()
            info[f"t5.{index}"] = sorted(options)
    if "transformer_file" in job:
        patcher = comfy.sd.load_diffusion_model(job["transformer_file"])
        model = patcher.model
        info["model"] = type(model.model_config).__name__
        info["depth"] = len(model.diffusion_model.blocks)
        info["scale_factor"] = model.latent_format.scale_factor
        inputs = load_file(job["inputs"])
        with torch.no_grad():
            eps = model.diffusion_model(
                inputs["x"].to(model.get_dtype()),
                inputs["t"],
                context=inputs["context"].to(model.get_dtype()),
            )
        out["eps"] = eps.float().contiguous()
    save_file(out, out_path)
    with open(out_path + ".json", "w") as f:
        json.dump(info, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
