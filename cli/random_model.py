"""PixArt-Σ-architecture models with random weights, saved in the diffusers folder layout.

``tiny`` is for the demo and the tests (runs on a CPU in seconds); ``full`` has the published
PixArt-Sigma-XL-2-1024-MS shapes, for memory and speed benchmarks, where weights do not matter.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..core.models import MODEL_INDEX
from ..core.single_files import CAPTION_TOKENS, original_key_map
from ..core.text_encoder import quiet_progress_bars

logger = logging.getLogger(__name__)

# What every PixArt-Σ has; the presets below differ only in sizes.
ARCHITECTURE: dict[str, dict] = {
    "text_encoder": dict(feed_forward_proj="gated-gelu"),  # T5 v1.1
    "transformer": dict(
        in_channels=4,
        out_channels=8,  # learned sigma
        patch_size=2,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
        num_embeds_ada_norm=1000,
        activation_fn="gelu-approximate",
        attention_bias=True,
        use_additional_conditions=False,
    ),
    "vae": dict(  # SDXL VAE layout: four blocks, 8x downsampling
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        norm_num_groups=32,
        scaling_factor=0.13025,
    ),
}

SIZES: dict[str, dict[str, dict]] = {
    # Widths are multiples of 64: bitsandbytes' packed 4-bit CPU path needs that.
    "tiny": {
        "text_encoder": dict(
            d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2,
            relative_attention_num_buckets=8, relative_attention_max_distance=32,
        ),
        "transformer": dict(
            sample_size=8, num_layers=2, attention_head_dim=32, num_attention_heads=2,
            caption_channels=64, cross_attention_dim=64, interpolation_scale=1,
        ),
        # The real SDXL VAE's widths: ComfyUI's VAELoader builds that architecture whatever the file holds,
        # so only a full-width VAE can be loaded by both the pack and core ComfyUI (interop tests).
        "vae": dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, sample_size=64),
    },
    # The smallest model ComfyUI core loads too: core fixes the transformer's width (1152, 16 heads of 72)
    # and caption width (4096, so T5's d_model) and reads only the depth from the weights. 512 px native:
    # core's position embedding needs an image side of about 320 px or more.
    "tiny-core": {
        "text_encoder": dict(
            d_model=4096, d_kv=32, d_ff=128, num_layers=1, num_heads=2,
            relative_attention_num_buckets=8, relative_attention_max_distance=32,
        ),
        "transformer": dict(
            sample_size=64, num_layers=1, attention_head_dim=72, num_attention_heads=16,
            caption_channels=4096, cross_attention_dim=1152, interpolation_scale=1,
        ),
        "vae": dict(block_out_channels=(32, 32, 32, 32), layers_per_block=1, sample_size=64),
    },
    # The published PixArt-alpha/PixArt-Sigma-XL-2-1024-MS: google/t5-v1_1-xxl encoder, XL-2
    # transformer, SDXL VAE.
    "full": {
        "text_encoder": dict(
            d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
            relative_attention_num_buckets=32, relative_attention_max_distance=128, vocab_size=32128,
        ),
        "transformer": dict(
            sample_size=128, num_layers=28, attention_head_dim=72, num_attention_heads=16,
            caption_channels=4096, cross_attention_dim=1152, interpolation_scale=2,
        ),
        "vae": dict(
            block_out_channels=(128, 256, 512, 512), layers_per_block=2, sample_size=1024, force_upcast=True
        ),
    },
}  # fmt: skip

PRESETS: dict[str, dict[str, dict]] = {
    preset: {part: ARCHITECTURE[part] | sizes[part] for part in ARCHITECTURE}
    for preset, sizes in SIZES.items()
}

SCHEDULER = dict(
    algorithm_type="dpmsolver++",
    beta_start=0.0001,
    beta_end=0.02,
    beta_schedule="linear",
    num_train_timesteps=1000,
    prediction_type="epsilon",
    solver_order=2,
    lower_order_final=True,
    timestep_spacing="linspace",
)

WORDS = [
    "a",
    "photo",
    "of",
    "the",
    "an",
    "in",
    "on",
    "with",
    "red",
    "green",
    "blue",
    "yellow",
    "black",
    "white",
    "cat",
    "dog",
    "bird",
    "tree",
    "house",
    "sky",
    "sea",
    "mountain",
    "city",
    "street",
    "small",
    "big",
    "old",
    "young",
    "person",
    "woman",
    "man",
    "car",
    "flower",
    "garden",
    "night",
    "day",
    "sun",
    "moon",
    "painting",
    "portrait",
    "landscape",
    "detailed",
    "style",
    "light",
    "dark",
]


def build_tokenizer(vocab_size: int):
    """A T5 (unigram) tokenizer built in memory: whole words, then characters, padded with filler
    pieces to ``vocab_size`` - 100 so token ids cover the embedding table like the real one."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("▁" + w, -1.0) for w in WORDS] + [("▁", -2.0)]
    pieces += [
        (c, -3.0) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"-()"
    ]
    filler = vocab_size - 100 - len(pieces)
    pieces += [(f"▁x{i}", -10.0) for i in range(max(filler, 0))]
    return T5Tokenizer(vocab=pieces, extra_ids=100)


def build_random_pixart(
    folder: str | os.PathLike,
    preset: str = "tiny",
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    text_encoder: bool = True,
) -> Path:
    """Write a random PixArt-Σ-architecture model to ``folder`` (atomically: built beside it, then renamed);
    without ``text_encoder``, only the transformer, scheduler and VAE (what sampling and decoding read)."""
    from diffusers import (
        AutoencoderKL,
        DPMSolverMultistepScheduler,
        PixArtSigmaPipeline,
        PixArtTransformer2DModel,
    )
    from transformers import T5Config, T5EncoderModel

    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r} is unknown; choose one of {', '.join(PRESETS)}.")
    shapes = PRESETS[preset]
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    te_config = dict(shapes["text_encoder"])
    vocab_size = te_config.pop("vocab_size", 160 + 100)
    tokenizer = build_tokenizer(vocab_size)
    with torch.device(device):
        encoder = (
            T5EncoderModel(
                T5Config(vocab_size=len(tokenizer), is_encoder_decoder=False, use_cache=False, **te_config)
            )
            if text_encoder
            else None
        )
        transformer = PixArtTransformer2DModel(**shapes["transformer"])
        vae = AutoencoderKL(**shapes["vae"])
    if dtype != torch.float32:
        for module in (encoder, transformer, vae):
            if module is not None:
                module.to(dtype)
    pipe = PixArtSigmaPipeline(
        tokenizer=tokenizer if text_encoder else None,
        text_encoder=encoder,
        transformer=transformer,
        vae=vae,
        scheduler=DPMSolverMultistepScheduler(**SCHEDULER),
    )
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        with quiet_progress_bars():
            pipe.save_pretrained(staging, safe_serialization=True)
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("built a random %s PixArt-Σ model in %s", preset, folder)
    return folder


def ensure_random_pixart(folder: str | os.PathLike, preset: str = "tiny", **kwargs) -> Path:
    """Build the model once; later calls reuse the folder."""
    folder = Path(folder)
    if (folder / MODEL_INDEX).is_file():
        return folder
    return build_random_pixart(folder, preset, **kwargs)


def save_single_file_transformer(folder: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Write the transformer of the diffusers model ``folder`` as one safetensors file in the original
    PixArt layout, the one ComfyUI's Load Diffusion Model (UNETLoader) reads: q, k, v fused, PixArt's
    key names, and a zero empty-caption table of 300 rows (diffusers keeps none; only its length is read)."""
    from safetensors.torch import load_file, save_file

    source = Path(folder) / "transformer"
    weights = sorted(source.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"{source} holds no .safetensors weights to convert.")
    state: dict[str, torch.Tensor] = {}
    for file in weights:  # one file, or the shards of a large model
        state.update(load_file(file))
    depth = 1 + max(int(key.split(".")[1]) for key in state if key.startswith("transformer_blocks."))
    out = {
        original: torch.cat([state[key] for key in targets]).contiguous()
        for original, targets in original_key_map(depth).items()
    }
    caption = state["caption_projection.linear_1.weight"]
    out["y_embedder.y_embedding"] = torch.zeros(CAPTION_TOKENS, caption.shape[1], dtype=caption.dtype)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file(out, partial, metadata={"format": "pt"})
    partial.replace(path)
    logger.info("wrote the transformer of %s as %s (original PixArt layout)", folder, path)
    return path


def save_single_file_t5(
    folder: str | os.PathLike, path: str | os.PathLike, dtype: torch.dtype = torch.float16
) -> Path:
    """Write the T5 encoder of the diffusers model ``folder`` as one safetensors file in the layout of
    ComfyUI's t5xxl files (``t5xxl_fp16.safetensors``), the one its Load CLIP (CLIPLoader) reads:
    ``shared.weight`` for the token embeddings (no tied ``encoder.embed_tokens`` copy) and ``encoder.…``,
    each tensor cast to ``dtype`` one at a time, so memory holds the output file's size and no more."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    source = Path(folder) / "text_encoder"
    weights = sorted(source.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"{source} holds no .safetensors weights to convert.")
    out: dict[str, torch.Tensor] = {}
    for file in weights:  # one file, or the shards of a large model
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118  (safe_open is not iterable)
                out[key] = f.get_tensor(key).to(dtype).contiguous()
    embeddings = out.pop("encoder.embed_tokens.weight", None)
    if "shared.weight" not in out:
        if embeddings is None:
            raise ValueError(
                f"{source} holds no token embeddings (shared.weight or encoder.embed_tokens.weight)."
            )
        out["shared.weight"] = embeddings
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file(out, partial, metadata={"format": "pt"})
    partial.replace(path)
    logger.info("wrote the T5 of %s as %s (ComfyUI's t5xxl layout, %s)", folder, path, dtype)
    return path


# The layers of a block a LoRA of PixArt-Σ usually trains: every attention projection and the feed-forward.
LORA_LAYERS = (
    "attn1.to_q",
    "attn1.to_k",
    "attn1.to_v",
    "attn1.to_out.0",
    "attn2.to_q",
    "attn2.to_k",
    "attn2.to_v",
    "attn2.to_out.0",
    "ff.net.0.proj",
    "ff.net.2",
)
LORA_FORMATS = {
    # (key prefix, up suffix, down suffix, writes alpha)
    "peft": ("transformer.", ".lora_B.weight", ".lora_A.weight", False),
    "kohya": ("transformer.", ".lora_up.weight", ".lora_down.weight", True),
    "peft-base-model": ("base_model.model.", ".lora_B.weight", ".lora_A.weight", False),
    "peft-unet": ("unet.base_model.model.", ".lora_B.weight", ".lora_A.weight", False),
}


def save_random_lora(
    folder: str | os.PathLike,
    path: str | os.PathLike,
    rank: int = 4,
    form: str = "peft",
    seed: int = 0,
    scale: float = 0.05,
    blocks: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a random LoRA of rank ``rank`` for the transformer of the diffusers model ``folder`` (its config
    gives the shapes): every attention and feed-forward layer (:data:`LORA_LAYERS`) of the first ``blocks``
    blocks (all by default), keyed in ``form`` (:data:`LORA_FORMATS`). Factors are drawn at ``scale``, so the
    delta is about ``scale² × rank`` an element."""
    import json

    from safetensors.torch import save_file

    if form not in LORA_FORMATS:
        raise ValueError(f"form {form!r} is unknown; choose one of {', '.join(LORA_FORMATS)}.")
    prefix, up_suffix, down_suffix, alpha = LORA_FORMATS[form]
    config = json.loads((Path(folder) / "transformer" / "config.json").read_text())
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    shapes = {  # (out, in) of each layer
        **{f"attn1.{n}": (hidden, hidden) for n in ("to_q", "to_k", "to_v", "to_out.0")},
        "attn2.to_q": (hidden, hidden),
        "attn2.to_k": (hidden, config["cross_attention_dim"] or hidden),
        "attn2.to_v": (hidden, config["cross_attention_dim"] or hidden),
        "attn2.to_out.0": (hidden, hidden),
        "ff.net.0.proj": (4 * hidden, hidden),
        "ff.net.2": (hidden, 4 * hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for block in range(config["num_layers"] if blocks is None else blocks):
        for layer in LORA_LAYERS:
            out, inner = shapes[layer]
            stem = f"{prefix}transformer_blocks.{block}.{layer}"
            state[stem + up_suffix] = (torch.randn(out, rank, generator=generator) * scale).to(dtype)
            state[stem + down_suffix] = (torch.randn(rank, inner, generator=generator) * scale).to(dtype)
            if alpha:
                state[stem + ".alpha"] = torch.tensor(float(rank) / 2)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, path)
    return path
