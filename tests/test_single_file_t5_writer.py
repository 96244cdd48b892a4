"""save_single_file_t5: a diffusers folder's T5 as one file in ComfyUI's t5xxl layout (what the ComfyUI
core-path benchmark hands to core's Load CLIP), read back by the pack as a T5 file of the same config."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from pixart_lowvram.cli.random_model import PRESETS, save_single_file_t5
from pixart_lowvram.core.single_files import read_t5_file


def test_t5_file_holds_the_folders_weights_in_the_t5xxl_layout(tiny_folder, tmp_path):
    path = save_single_file_t5(tiny_folder, tmp_path / "t5xxl_fp16.safetensors")
    written = load_file(path)
    folder = {}
    for file in sorted((tiny_folder / "text_encoder").glob("*.safetensors")):
        folder.update(load_file(file))
    assert "shared.weight" in written and "encoder.embed_tokens.weight" not in written
    assert all(key == "shared.weight" or key.startswith("encoder.") for key in written)
    assert {t.dtype for t in written.values()} == {torch.float16}
    embeddings = folder.get("shared.weight", folder.get("encoder.embed_tokens.weight"))
    assert torch.equal(written["shared.weight"], embeddings.half())
    for key, value in folder.items():
        if key not in ("shared.weight", "encoder.embed_tokens.weight"):
            assert torch.equal(written[key], value.half()), key
    config = read_t5_file(path).config
    expected = PRESETS["tiny"]["text_encoder"]
    assert {key: config[key] for key in ("d_model", "d_ff", "num_layers", "num_heads")} == {
        key: expected[key] for key in ("d_model", "d_ff", "num_layers", "num_heads")
    }
    assert not path.with_name(path.name + ".partial").exists()


def test_bf16_on_request(tiny_folder, tmp_path):
    path = save_single_file_t5(tiny_folder, tmp_path / "t5.safetensors", dtype=torch.bfloat16)
    assert {t.dtype for t in load_file(path).values()} == {torch.bfloat16}
