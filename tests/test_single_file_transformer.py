"""The transformer from one safetensors file: the converter to the original PixArt layout (what ComfyUI's
Load Diffusion Model reads), loading that file (or a diffusers-layout one, or a full checkpoint's prefixed
keys) gives the folder's samples exactly, files that are not a PixArt-Σ transformer are refused before
anything loads, the native size follows the variant, and a transformer-only folder (the 2K model)
borrows T5, tokenizer and VAE from a complete folder."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pixart_lowvram.cli.random_model import CAPTION_TOKENS, save_single_file_transformer
from pixart_lowvram.core import sampler, sampler_settings, text_encoder, vae
from pixart_lowvram.core.models import (
    CONFIG_FILES,
    HUB_1024,
    HUB_IDS,
    WEIGHTED,
    resolve_model,
)
from pixart_lowvram.core.single_files import read_transformer_file

FP32 = {"quantization": "none", "device": "cpu", "precision": torch.float32}
SIZE = 64  # the tiny model's native size
SETTINGS = {"width": SIZE, "height": SIZE, "steps": 2, "cfg": 4.5, "seed": 7}


def sample(source, embeds, **settings):
    """The sampling stage with ``settings`` (SamplerSettings' fields), built and checked before it runs."""
    return sampler.sample(sampler_settings.SamplerSettings(source, **settings), embeds)


def folder_config(folder: Path) -> dict:
    return json.loads((folder / "transformer" / "config.json").read_text())


def diffusers_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")


@pytest.fixture(scope="module")
def original(tiny_folder, tmp_path_factory) -> Path:
    return save_single_file_transformer(
        tiny_folder, tmp_path_factory.mktemp("single") / "tiny-pixart.safetensors"
    )


def test_converter_writes_the_original_layout(original, tiny_folder):
    state = load_file(original)
    width = (
        folder_config(tiny_folder)["num_attention_heads"] * folder_config(tiny_folder)["attention_head_dim"]
    )
    assert "t_block.1.weight" in state and "final_layer.scale_shift_table" in state
    assert not [key for key in state if key.startswith(("transformer_blocks.", "adaln_single", "pos_embed."))]
    assert state["blocks.1.attn.qkv.weight"].shape == (3 * width, width)
    assert state["blocks.1.cross_attn.kv_linear.bias"].shape == (2 * width,)
    assert state["y_embedder.y_embedding"].shape == (
        CAPTION_TOKENS,
        folder_config(tiny_folder)["caption_channels"],
    )
    weights = diffusers_weights(tiny_folder)
    q, k, v = (weights[f"transformer_blocks.1.attn1.to_{n}.weight"] for n in "qkv")
    assert torch.equal(state["blocks.1.attn.qkv.weight"], torch.cat([q, k, v]))


def test_reading_it_back_gives_the_folders_weights_and_config(original, tiny_folder):
    file = read_transformer_file(original, folder_config(tiny_folder))
    assert file.layout == "original"
    config = folder_config(tiny_folder)
    assert {key: config[key] for key in file.config} == file.config
    weights, got = diffusers_weights(tiny_folder), file.state_dict()
    assert got.keys() == weights.keys()
    assert all(torch.equal(got[key], weights[key]) for key in weights)


def prefixed(original: Path, path: Path) -> Path:
    """A full ComfyUI checkpoint keeps the transformer under model.diffusion_model."""
    state = load_file(original)
    save_file({f"model.diffusion_model.{key}": value for key, value in state.items()}, path)
    return path


@pytest.mark.parametrize("layout", ["original", "diffusers", "checkpoint"])
def test_single_file_samples_equal_the_folders(tiny, tiny_folder, reference, original, tmp_path, layout):
    path = {
        "original": lambda: original,
        "diffusers": lambda: tiny_folder / "transformer" / "diffusion_pytorch_model.safetensors",
        "checkpoint": lambda: prefixed(original, tmp_path / "pixart.safetensors"),
    }[layout]()
    latents = sample(tiny, reference.embeds, **SETTINGS, **FP32, transformer_file=path)
    # Exact: the folder's weights bit for bit in the same architecture: the same kernels on the same data.
    assert torch.equal(latents, reference.latents)


@pytest.mark.parametrize(("quantization", "dtype"), [("qint8", torch.float32), ("none", torch.bfloat16)])
def test_single_file_matches_the_folder_quantized_and_in_bf16(tiny, reference, original, quantization, dtype):
    settings = {**SETTINGS, "quantization": quantization, "device": "cpu", "precision": dtype}
    from_file = sample(tiny, reference.embeds, **settings, transformer_file=original)
    assert torch.equal(from_file, sample(tiny, reference.embeds, **settings))


def alpha(path: Path, state: dict) -> None:
    save_file({**state, "ar_embedder.mlp.0.weight": torch.zeros(4, 4)}, path)


def without_block_weight(path: Path, state: dict) -> None:
    save_file({key: value for key, value in state.items() if key != "blocks.1.mlp.fc2.bias"}, path)


def kv_compressed(path: Path, state: dict) -> None:
    save_file({**state, "blocks.0.attn.sr.weight": torch.zeros(4, 4)}, path)


def t5_like(path: Path, _state: dict) -> None:
    save_file({"shared.weight": torch.zeros(4, 4), "encoder.final_layer_norm.weight": torch.zeros(4)}, path)


def truncated(path: Path, _state: dict) -> None:
    path.write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{")


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (alpha, "PixArt-α"),
        (without_block_weight, "lacks blocks.1.mlp.fc2.bias"),
        (kv_compressed, "has blocks.0.attn.sr.weight"),
        (t5_like, "not a PixArt transformer"),
        (truncated, "not a readable safetensors file"),
    ],
)
def test_wrong_files_are_refused_before_loading(
    original, load_spy, tmp_path, tiny, reference, write, message
):
    path = tmp_path / "wrong.safetensors"
    write(path, load_file(original))
    with pytest.raises(ValueError, match=message) as error:
        sample(tiny, reference.embeds, **SETTINGS, **FP32, transformer_file=path)
    assert any(fix in str(error.value) for fix in ("models/diffusion_models", "download it again"))
    assert load_spy.count("transformer") == 0


@pytest.mark.parametrize("suffix", [".pth", ".ckpt", ".bin"])
def test_pickles_are_refused_unopened(tmp_path, tiny, reference, load_spy, suffix):
    path = tmp_path / f"pixart{suffix}"
    path.write_bytes(pickle.dumps({"t_block.1.weight": 0}))
    with pytest.raises(ValueError, match=r"only \.safetensors files are read"):
        sample(tiny, reference.embeds, **SETTINGS, **FP32, transformer_file=path)
    assert load_spy.count("transformer") == 0


def test_unknown_head_count_asks_for_the_model_folder(original):
    with pytest.raises(ValueError, match="how many heads"):
        read_transformer_file(original)  # 64 wide, no folder config: not PixArt's 72-wide heads


@pytest.mark.parametrize(
    ("name", "native", "scale"),
    [
        ("PixArt-Sigma-XL-2-512-MS.safetensors", 512, 1.0),
        ("PixArt-Sigma-XL-2-1024-MS.safetensors", 1024, 2.0),
        ("PixArt-Sigma-XL-2-2K-MS.safetensors", 2048, 4.0),
        ("pixart_sigma_2048.safetensors", 2048, 4.0),
        ("tiny.safetensors", SIZE, 1),  # no size in the name: the model folder's
    ],
)
def test_native_size_follows_the_variant(original, tiny, tmp_path, name, native, scale):
    path = tmp_path / name
    shutil.copy(original, path)
    file = read_transformer_file(path, tiny.config("transformer"))
    assert (file.native_size, file.config["interpolation_scale"]) == (native, scale)
    assert sampler_settings.SamplerSettings(tiny, transformer_file=path).native_size == native


def test_native_size_of_a_folder(tiny):
    assert tiny.native_size == sampler_settings.SamplerSettings(tiny).native_size == SIZE


def transformer_only(tiny_folder: Path, folder: Path, sample_size: int | None = None) -> Path:
    """A folder like the published 2K model: model_index.json, transformer/ and scheduler/ only."""
    folder.mkdir(parents=True)
    shutil.copy(tiny_folder / "model_index.json", folder)
    for component in ("transformer", "scheduler"):
        shutil.copytree(tiny_folder / component, folder / component)
    if sample_size is not None:
        config = folder_config(folder) | {"sample_size": sample_size}
        (folder / "transformer" / "config.json").write_text(json.dumps(config))
    return folder


def test_a_transformer_only_folder_borrows_t5_tokenizer_and_vae(tiny, tiny_folder, reference, tmp_path):
    root = tmp_path / "diffusers"
    shutil.copytree(tiny_folder, root / "sigma-1024")
    transformer_only(tiny_folder, root / "sigma-2k")
    source = resolve_model("sigma-2k", [root])
    assert source.base is not None and source.base.path == (root / "sigma-1024").resolve()
    assert source.folder(["vae"]) == source.base.path
    assert source.folder(["transformer", "scheduler"]) == source.path
    source.check_complete()  # the lent parts included
    embeds = text_encoder.encode(
        text_encoder.EncoderSettings(source, **FP32), reference.prompt, reference.negative
    )
    assert torch.equal(embeds.prompt_embeds, reference.embeds.prompt_embeds)
    latents = sample(source, embeds, **SETTINGS, **FP32)
    assert torch.equal(latents, reference.latents)
    images = vae.decode(vae.DecoderSettings(source, device="cpu", precision=torch.float32), latents)
    assert torch.equal(images, reference.images)


def complete_stub(folder: Path, sample_size: int) -> None:
    """A folder that can lend: a PixArt-Σ pipeline by its model_index.json, each component with its config
    and what its own check reads (a tokenizer vocabulary, a readable safetensors file)."""
    for component, config in CONFIG_FILES.items():
        (folder / component).mkdir(parents=True)
        (folder / component / config).write_text("{}")
        if component in WEIGHTED:
            save_file({"weight": torch.zeros(1)}, folder / component / "diffusion_pytorch_model.safetensors")
    (folder / "tokenizer" / "tokenizer.json").write_text("{}")
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "PixArtSigmaPipeline"}))
    (folder / "transformer" / "config.json").write_text(json.dumps({"sample_size": sample_size}))


def test_the_1024_folder_is_lent_first(tiny_folder, tmp_path):
    root = tmp_path / "diffusers"
    complete_stub(root / "a-sigma-512", 64)
    complete_stub(root / "z-sigma-1024", 128)
    transformer_only(tiny_folder, root / "sigma-2k", sample_size=256)
    assert resolve_model("sigma-2k", [root]).base.path == (root / "z-sigma-1024").resolve()
    assert resolve_model("z-sigma-1024", [root]).base is None


def test_no_folder_to_borrow_from_says_so(tiny_folder, reference, tmp_path, load_spy):
    root = tmp_path / "diffusers"
    transformer_only(tiny_folder, root / "sigma-2k")
    source = resolve_model("sigma-2k", [root])
    assert source.base is None
    with pytest.raises(FileNotFoundError, match="borrows them from a complete PixArt-Σ 1024 folder") as error:
        text_encoder.encode(text_encoder.EncoderSettings(source, **FP32), reference.prompt)
    assert str(root) in str(error.value)
    assert load_spy.total() == 0


def test_the_2k_and_512_hub_models_borrow_from_the_1024_one():
    for hub_id in HUB_IDS:
        base = resolve_model(hub_id).base
        assert (base.hub_id if base else None) == (None if hub_id == HUB_1024 else HUB_1024)


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_comfyuis_attention_settings_in_a_checkpoint_are_left_out(
    original, tiny_folder, tmp_path, prefix, caplog
):
    """A checkpoint saved by ComfyUI 0.38 may hold, beside the weights, one attention setting per attention
    layer (``blocks.N.attn.comfy_attention.config``, a JSON text as uint8): the file reads as the same
    transformer, the settings left out and said so; without them the same weights and config."""
    setting = torch.tensor(list(json.dumps({"attention": "comfy_kitchen_int8"}).encode()), dtype=torch.uint8)
    weights = {prefix + key: tensor for key, tensor in load_file(original).items()}
    depth = folder_config(tiny_folder)["num_layers"]
    settings = {
        f"{prefix}blocks.{block}.{layer}.comfy_attention.config": setting.clone()
        for block in range(depth)
        for layer in ("attn", "cross_attn")
    }
    plain, with_settings = tmp_path / "plain.safetensors", tmp_path / "with_settings.safetensors"
    save_file(weights, plain)
    save_file({**weights, **settings}, with_settings)
    expected = read_transformer_file(plain, folder_config(tiny_folder))
    with caplog.at_level("INFO", logger="pixart_lowvram.core.single_files"):
        got = read_transformer_file(with_settings, folder_config(tiny_folder))
    assert f"leaving out {2 * depth} per-layer attention settings of ComfyUI's" in caplog.text
    assert (got.config, got.layout, got.prefix) == (expected.config, expected.layout, expected.prefix)
    state, expected_state = got.state_dict(), expected.state_dict()
    assert state.keys() == expected_state.keys()
    assert all(torch.equal(state[key], expected_state[key]) for key in state)
