"""The SDXL VAE's two single-file layouts: diffusers' key names (``diffusion_pytorch_model.safetensors``) and
the original (ldm) ones most ``sdxl_vae.safetensors`` downloads use. The tests (and tools/same_images.py)
write the tiny model's VAE in the original layout, to check that ComfyUI's VAELoader and the pack both read
what users have."""

from __future__ import annotations

import re

import torch

_RESNET = {"conv_shortcut": "nin_shortcut"}
_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def _rename(key: str, up_blocks: int) -> str:
    key = key.replace("conv_norm_out", "norm_out")
    if match := re.match(r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.*)", key):
        part, index, rest = match.groups()
        return f"{part}.mid.block_{int(index) + 1}.{_RESNET.get(rest.split('.')[0], rest.split('.')[0])}.{rest.split('.', 1)[1]}"
    if match := re.match(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.*)\.(weight|bias)", key):
        part, name, kind = match.groups()
        return f"{part}.mid.attn_1.{_ATTENTION[name]}.{kind}"
    if match := re.match(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(\w+)\.(.*)", key):
        block, index, name, rest = match.groups()
        return f"encoder.down.{block}.block.{index}.{_RESNET.get(name, name)}.{rest}"
    if match := re.match(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.(.*)", key):
        return f"encoder.down.{match[1]}.downsample.{match[2]}"
    if match := re.match(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(\w+)\.(.*)", key):
        block, index, name, rest = match.groups()
        # ldm numbers the decoder's blocks from the lowest resolution up, diffusers the other way.
        return f"decoder.up.{up_blocks - 1 - int(block)}.block.{index}.{_RESNET.get(name, name)}.{rest}"
    if match := re.match(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.*)", key):
        return f"decoder.up.{up_blocks - 1 - int(match[1])}.upsample.{match[2]}"
    return key


def to_original_layout(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers ``AutoencoderKL`` keys -> the original layout (the mid attention's projections become 1x1
    convolutions there)."""
    up_blocks = 1 + max(int(k.split(".")[2]) for k in state_dict if k.startswith("decoder.up_blocks."))
    converted = {}
    for key, tensor in state_dict.items():
        new = _rename(key, up_blocks)
        if ".mid.attn_1." in new and new.endswith(".weight") and tensor.ndim == 2:
            tensor = tensor[:, :, None, None]
        converted[new] = tensor.contiguous()
    return converted
