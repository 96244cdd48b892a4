"""T5 from one safetensors file, as ComfyUI keeps it in models/text_encoders (t5xxl_fp16,
t5xxl_fp8_e4m3fn, bf16, scaled fp8): config inferred from the shapes, the same embeddings as the same
weights in a diffusers folder, the same quantization path and cache, tokenizer fallback, and files
that are not a T5 encoder refused before anything loads (pickles never opened)."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
from safetensors.torch import save_file

from pixart_lowvram.cli.random_model import PRESETS, build_tokenizer
from pixart_lowvram.core import quant_cache, text_encoder
from pixart_lowvram.core.models import resolve_model
from pixart_lowvram.core.pool import cache
from pixart_lowvram.core.single_files import read_t5_file

PROMPT, NEGATIVE = "a photo of a red cat in a garden", "dark"
FP32 = {"quantization": "none", "device": "cpu", "precision": torch.float32}
CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn
LINEAR = (".q.weight", ".k.weight", ".v.weight", ".o.weight", ".wi_0.weight", ".wi_1.weight", ".wo.weight")
SCALE = 0.5  # a power of two: stored / scale stays exact in fp8
# The tiny preset's T5 with the distance every real T5 file implies (it is not in the weights).
CONFIG = {**PRESETS["tiny"]["text_encoder"], "relative_attention_max_distance": 128, "vocab_size": 260}
INFERRED = (
    "vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads",
    "relative_attention_num_buckets", "relative_attention_max_distance", "feed_forward_proj",
)  # fmt: skip


def t5_state(config: dict) -> dict[str, torch.Tensor]:
    """A random T5 encoder's weights as a t5xxl file holds them (no tied embed_tokens copy), every value
    exactly representable in fp8 so that fp32, fp16, bf16 and fp8 files hold the same weights."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    model = T5EncoderModel(T5Config(is_encoder_decoder=False, use_cache=False, **config))
    state = model.state_dict()
    del state["encoder.embed_tokens.weight"]
    return {key: value.to(FP8).float().contiguous() for key, value in state.items()}


def scaled_fp8(state: dict, scale_name: str = "scale_weight") -> dict:
    """ComfyUI's scaled fp8 layout: linear weights stored divided by a per-tensor scale, a marker tensor
    (its newer quantized layout names the scale ``weight_scale``)."""
    out = {"scaled_fp8": torch.empty(0, dtype=FP8)}
    for key, value in state.items():
        if key.endswith(LINEAR):
            out[key] = (value / SCALE).to(FP8)
            out[key.removesuffix("weight") + scale_name] = torch.tensor(SCALE)
            out[key.removesuffix("weight") + "scale_input"] = torch.tensor(1.0)
        else:
            out[key] = value.half()
    return out


def embed_tokens_only(state: dict) -> dict:
    out = {key: value.half() for key, value in state.items()}
    out["encoder.embed_tokens.weight"] = out.pop("shared.weight")
    out["logit_scale"] = torch.tensor(4.6)  # a stray extra some files carry
    return out


VARIANTS = {
    "fp16": lambda state: {key: value.half() for key, value in state.items()},
    "bf16": lambda state: {key: value.bfloat16() for key, value in state.items()},
    "fp8_e4m3fn": lambda state: {key: value.to(FP8) for key, value in state.items()},
    "fp8_e4m3fn_scaled": scaled_fp8,
    "fp8_weight_scale": lambda state: scaled_fp8(state, "weight_scale"),
    "embed_tokens": embed_tokens_only,
}


def encode(source, prompt, negative_prompt="", **settings):
    """The T5 stage with ``settings`` (EncoderSettings' fields), built and checked before it runs."""
    return text_encoder.encode(text_encoder.EncoderSettings(source, **settings), prompt, negative_prompt)


@pytest.fixture(scope="module")
def weights(tmp_path_factory, tiny_folder) -> dict:
    """A PixArt folder whose text_encoder/ holds the T5 (fp32), and that T5 as single files."""
    from transformers import T5Config, T5EncoderModel

    root = tmp_path_factory.mktemp("single_file_t5")
    state = t5_state(CONFIG)
    folder = root / "pixart"
    shutil.copytree(tiny_folder, folder, ignore=shutil.ignore_patterns("text_encoder"))
    model = T5EncoderModel(T5Config(is_encoder_decoder=False, use_cache=False, **CONFIG))
    model.load_state_dict(state, strict=False)  # embed_tokens is tied to shared
    model.save_pretrained(folder / "text_encoder")
    files = {}
    for name, variant in VARIANTS.items():
        files[name] = root / f"t5xxl_{name}.safetensors"
        save_file(variant(state), files[name])
    return {
        "folder": folder,
        "source": resolve_model(str(folder)),
        "state": state,
        "files": files,
        "root": root,
    }


@pytest.fixture(scope="module")
def folder_embeds(weights):
    return encode(weights["source"], PROMPT, NEGATIVE, **FP32)


def assert_same(got, want):
    """Bit for bit: every file holds the folder's weights exactly (t5_state), loaded into the same model, so
    the same kernels run on the same data."""
    for name in ("prompt_embeds", "prompt_mask", "negative_embeds", "negative_mask"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_is_inferred_from_the_shapes(weights, variant):
    config = read_t5_file(weights["files"][variant]).config
    assert {key: config[key] for key in INFERRED} == {"feed_forward_proj": "gated-gelu", **CONFIG}


def test_relu_t5_is_inferred_too(tmp_path):
    config = {**CONFIG, "feed_forward_proj": "relu", "d_ff": 192, "num_layers": 3, "num_heads": 4, "d_kv": 16}
    path = tmp_path / "t5_relu.safetensors"
    save_file({key: value.half() for key, value in t5_state(config).items()}, path)
    inferred = read_t5_file(path)
    assert {key: inferred.config[key] for key in INFERRED} == config
    assert inferred.stored_dtype == "F16"


@pytest.mark.parametrize("variant", VARIANTS)
def test_file_gives_the_folders_embeddings(weights, folder_embeds, variant):
    got = encode(weights["source"], PROMPT, NEGATIVE, t5_file=weights["files"][variant], **FP32)
    assert_same(got, folder_embeds)
    assert got.model == weights["source"].key  # the PixArt model names the embeddings


@pytest.fixture(scope="module")
def folder_nf4(weights):
    return encode(weights["source"], PROMPT, NEGATIVE, quantization="nf4", device="cpu")


@pytest.mark.parametrize("variant", ["fp16", "fp8_e4m3fn", "fp8_e4m3fn_scaled"])
def test_nf4_from_a_file_is_the_folders_nf4(weights, folder_nf4, variant):
    """The same weights quantize to the same 4-bit model, whichever way they are stored."""
    got = encode(
        weights["source"],
        PROMPT,
        NEGATIVE,
        quantization="nf4",
        device="cpu",
        t5_file=weights["files"][variant],
    )
    assert_same(got, folder_nf4)
    assert got.quantization == "bitsandbytes nf4"


def test_nf4_quantizes_every_linear_layer_of_a_file(weights):
    settings = text_encoder.EncoderSettings(
        weights["source"],
        quantization="nf4",
        device=CPU,
        precision=torch.bfloat16,
        t5_file=weights["files"]["fp8_e4m3fn"],
    )
    model = text_encoder._load(settings)
    for block in model.encoder.block:
        assert type(block.layer[-1].DenseReluDense.wo) is bnb.nn.Linear4bit
        assert type(block.layer[0].SelfAttention.q) is bnb.nn.Linear4bit


def test_quant_cache_is_keyed_by_the_file(weights, tmp_path):
    path = tmp_path / "t5xxl_fp16.safetensors"
    shutil.copy(weights["files"]["fp16"], path)
    cache_dir = tmp_path / "cache"

    def encode_file():
        return encode(
            weights["source"],
            PROMPT,
            quantization="nf4",
            device="cpu",
            t5_file=path,
            quant_cache=cache_dir,
        ).prompt_embeds

    first = encode_file()
    (entry,) = quant_cache.entries(cache_dir)
    assert torch.equal(encode_file(), first)
    assert quant_cache.entries(cache_dir) == [entry]
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    encode_file()
    assert len(quant_cache.entries(cache_dir)) == 2


def test_a_kept_folder_t5_is_not_reused_for_a_file(weights):
    encode(weights["source"], PROMPT, keep_loaded=True, **FP32)
    encode(weights["source"], PROMPT, keep_loaded=True, t5_file=weights["files"]["fp16"], **FP32)
    assert len(cache) == 2


def clip_like(path: Path) -> None:
    save_file({"text_model.encoder.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64)}, path)


def llama_like(path: Path) -> None:
    save_file({"model.embed_tokens.weight": torch.zeros(8, 64), "model.norm.weight": torch.ones(64)}, path)


def edited(change):
    def write(path: Path, state: dict) -> None:
        tensors = {key: value.half() for key, value in state.items()}
        change(tensors)
        save_file(tensors, path)

    return write


def truncated(path: Path, state: dict) -> None:
    save_file({key: value.half() for key, value in state.items()}, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


BLOCK1_WO = "encoder.block.1.layer.1.DenseReluDense.wo.weight"
BIAS = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
UMT5_BIAS = BIAS.replace("block.0", "block.1")  # UMT5 has a position bias in every layer
Q = "encoder.block.0.layer.0.SelfAttention.q.weight"


@pytest.mark.parametrize(
    ("name", "write", "error", "message"),
    [
        ("clip_l.safetensors", lambda p, s: clip_like(p), ValueError, "is not a T5 encoder"),
        ("llama.safetensors", lambda p, s: llama_like(p), ValueError, "is not a T5 encoder"),
        ("cut.safetensors", truncated, ValueError, "download it again"),
        ("no_wo.safetensors", edited(lambda t: t.pop(BLOCK1_WO)), ValueError, "lacks 1 of the 21 weights"),
        ("umt5.safetensors", edited(lambda t: t.update({UMT5_BIAS: t[BIAS].clone()})),
         ValueError, "is a UMT5 encoder"),
        ("int8.safetensors", edited(lambda t: t.update({Q: t[Q].to(torch.int8)})), ValueError, "quantized format"),
        ("per_row.safetensors", edited(lambda t: t.update({Q[:-6] + "scale_weight": torch.ones(64, 1)})),
         ValueError, "only one scale per weight"),
        ("missing.safetensors", None, FileNotFoundError, "does not exist"),
    ],
)  # fmt: skip
def test_wrong_files_are_refused_before_loading(weights, load_spy, tmp_path, name, write, error, message):
    path = tmp_path / name
    if write is not None:
        write(path, weights["state"])
    with pytest.raises(error, match=message) as raised:
        encode(weights["source"], PROMPT, t5_file=path, **FP32)
    assert name in str(raised.value)
    assert "models/text_encoders" in str(raised.value) or "download" in str(raised.value)  # where the fix is
    assert load_spy.total() == 0


class Trap:
    """Unpickling this creates a file: proof that a pickle was opened."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".ckpt", ".pth"])
def test_pickles_are_refused_unopened(weights, load_spy, tmp_path, suffix):
    marker = tmp_path / "unpickled"
    path = tmp_path / f"t5xxl{suffix}"
    path.write_bytes(pickle.dumps(Trap(marker)))
    with pytest.raises(ValueError, match=r"only \.safetensors files are read") as raised:
        encode(weights["source"], PROMPT, t5_file=path, **FP32)
    assert path.name in str(raised.value) and "never opens" in str(raised.value)
    assert not marker.exists()
    assert load_spy.total() == 0


@pytest.fixture(scope="module")
def no_tokenizer(weights) -> tuple:
    """The PixArt folder without tokenizer/, and its tokenizer moved to a folder of its own. The folder
    sits alone in its parent: beside a complete PixArt folder it would borrow that one's tokenizer."""
    folder = weights["root"] / "alone" / "pixart-no-tokenizer"
    shutil.copytree(weights["folder"], folder)
    tokenizer = weights["root"] / "t5_tokenizer"
    shutil.move(folder / "tokenizer", tokenizer)
    return resolve_model(str(folder)), tokenizer


def test_tokenizer_falls_back_when_the_folder_has_none(weights, folder_embeds, no_tokenizer):
    source, tokenizer = no_tokenizer
    file = weights["files"]["fp16"]
    got = encode(source, PROMPT, NEGATIVE, t5_file=file, tokenizer_fallback=tokenizer, **FP32)
    assert_same(got, folder_embeds)


def test_the_folders_tokenizer_comes_first(weights, folder_embeds, tmp_path):
    # A fallback that is not a tokenizer would fail if it were read.
    got = encode(
        weights["source"],
        PROMPT,
        NEGATIVE,
        t5_file=weights["files"]["fp16"],
        tokenizer_fallback=tmp_path,
        **FP32,
    )
    assert_same(got, folder_embeds)


@pytest.mark.parametrize("fallback", [None, "absent"])
def test_no_tokenizer_anywhere_says_where_it_looked(weights, no_tokenizer, load_spy, tmp_path, fallback):
    source, _tokenizer = no_tokenizer
    fallback = tmp_path / fallback if fallback else None
    with pytest.raises(FileNotFoundError) as raised:
        encode(source, PROMPT, t5_file=weights["files"]["fp16"], tokenizer_fallback=fallback, **FP32)
    message = str(raised.value)
    assert "pixart-no-tokenizer" in message and "tokenizer/" in message
    assert (str(fallback) if fallback else "(none given)") in message
    assert load_spy.total() == 0


def test_a_tokenizer_larger_than_the_embeddings_is_refused(weights, no_tokenizer, load_spy, tmp_path):
    source, _tokenizer = no_tokenizer
    build_tokenizer(600).save_pretrained(tmp_path / "big")
    with pytest.raises(ValueError, match=r"has 260 token embeddings but the tokenizer .* has 600 tokens"):
        encode(source, PROMPT, t5_file=weights["files"]["fp16"], tokenizer_fallback=tmp_path / "big", **FP32)
    assert load_spy.total() == 0
