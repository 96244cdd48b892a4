"""Read single safetensors files from their headers alone: a T5 encoder (read_t5_file → T5File), a
PixArt-Σ transformer in the original or diffusers layout (read_transformer_file → TransformerFile,
original_key_map), any chosen file's tensors (read_single_file_header)."""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Original checkpoints hold the learned empty caption (one row per caption token); diffusers has no use
# for it, ComfyUI reads the caption length from its rows.
CAPTION_TOKENS = 300

T5_FILE_HINT = (
    "ComfyUI keeps T5-XXL text encoders as single .safetensors files in models/text_encoders, e.g. "
    "t5xxl_fp16.safetensors or t5xxl_fp8_e4m3fn.safetensors (the files SD3 and Flux use)."
)
# Not recorded in the weights; every published T5 uses 128 (also T5Config's default).
T5_MAX_DISTANCE = 128
_BLOCK = re.compile(r"encoder\.block\.(\d+)\.")
_EMBEDDINGS = ("shared.weight", "encoder.embed_tokens.weight")  # files carry one or both (tied)
_BIAS = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
_FINAL_NORM = "encoder.final_layer_norm.weight"
# Per-tensor fp8 scales (stored weight x scale = weight): ComfyUI's "scaled fp8" files name them
# `.scale_weight`, its newer quantized layout `.weight_scale`.
_SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
_FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


def _t5_block_keys(block: int, gated: bool) -> list[str]:
    layer = f"encoder.block.{block}.layer."
    feed_forward = ("wi_0", "wi_1", "wo") if gated else ("wi", "wo")
    return [
        *(f"{layer}0.SelfAttention.{name}.weight" for name in "qkvo"),
        f"{layer}0.layer_norm.weight",
        *(f"{layer}1.DenseReluDense.{name}.weight" for name in feed_forward),
        f"{layer}1.layer_norm.weight",
    ]


@dataclass(frozen=True)
class T5File:
    """A T5 encoder saved as one safetensors file (Hugging Face key names), config inferred from its shapes."""

    path: Path
    config: dict[str, Any]  # T5Config arguments
    weights: tuple[str, ...]  # the tensors the encoder uses
    scales: tuple[tuple[str, str], ...]  # (weight, its per-tensor scale) in scaled fp8 files
    stored_dtype: str  # safetensors' name for the linear weights' dtype, e.g. F16, F8_E4M3

    @property
    def key(self) -> str:
        """Identifies the weights for caches."""
        return str(self.path)

    def pretrained_kwargs(self, dtype: torch.dtype) -> dict[str, Any]:
        """``from_pretrained`` arguments. transformers reads one safetensors file when given its path and
        a config, casting each tensor (fp8 included) to ``dtype`` as it loads: no copy of the file.
        Scaled fp8 weights need their scales multiplied in first, so those are dequantized in memory
        (host memory: the encoder in ``dtype``, 9.5 GB for T5-XXL in bf16)."""
        from transformers import T5Config

        config = T5Config(**self.config)
        if not self.scales:
            return {"pretrained_model_name_or_path": str(self.path), "config": config}
        logger.info(
            "%s: multiplying in the per-tensor fp8 scales of %d weights", self.path.name, len(self.scales)
        )
        return {
            "pretrained_model_name_or_path": None,
            "config": config,
            "state_dict": self._dequantized(dtype),
        }

    def _dequantized(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        scales = dict(self.scales)
        state = {}
        with safe_open(self.path, framework="pt") as f:
            for key in self.weights:
                tensor = f.get_tensor(key)
                if key in scales:
                    tensor = tensor.float() * f.get_tensor(scales[key]).float()
                state[key] = tensor.to(dtype)
        return state


def read_single_file_header(
    path: str | os.PathLike, input_name: str, hint: str
) -> tuple[Path, dict[str, tuple[str, list[int]]]]:
    """The path and each tensor's (dtype, shape) of a single safetensors file chosen for ``input_name``
    (t5_file, transformer_file, vae_file), from its header only. Other formats are refused unopened
    (.bin/.pt/.ckpt files are pickles, which can run code when loaded); an unreadable header (a truncated
    download) is named. ``hint`` says where such files go."""
    path = Path(path).expanduser()
    if path.suffix.lower() != ".safetensors":
        kind = path.suffix or "file without an extension"
        raise ValueError(
            f"{input_name} {str(path)!r}: only .safetensors files are read; a {kind} file may be a pickle, "
            f"which can run code when loaded and which the pack never opens. Pick (or convert to) the "
            f".safetensors version. {hint}"
        )
    if not path.is_file():
        raise FileNotFoundError(f"{input_name} {str(path)!r} does not exist. {hint}")
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            slices = {key: f.get_slice(key) for key in f.keys()}  # noqa: SIM118  (not iterable)
            tensors = {key: (piece.get_dtype(), piece.get_shape()) for key, piece in slices.items()}
    except (SafetensorError, OSError) as exc:
        raise ValueError(
            f"{input_name} {str(path)!r} is not a readable safetensors file ({exc}). If it was downloaded, the "
            f"download is probably incomplete: download it again. {hint}"
        ) from exc
    return path, tensors


def read_t5_file(path: str | os.PathLike) -> T5File:
    """Check that ``path`` is a T5 encoder saved as one safetensors file and infer its config, reading
    only the file's header. Other formats are refused unread: .bin/.pt/.ckpt files are pickles."""
    path, tensors = read_single_file_header(path, "t5_file", T5_FILE_HINT)
    return _infer_t5(path, tensors)


def _infer_t5(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> T5File:
    name = path.name
    embeddings = [key for key in _EMBEDDINGS if key in tensors]
    blocks = {int(match.group(1)) for key in tensors if (match := _BLOCK.match(key))}
    if not embeddings or not blocks or _FINAL_NORM not in tensors:
        raise ValueError(
            f"t5_file {name!r} is not a T5 encoder: a T5 file has shared.weight, encoder.block.N.… and "
            f"{_FINAL_NORM}, this one starts with {', '.join(sorted(tensors)[:3]) or 'no tensors'}. A CLIP or "
            f"LLM text encoder does not fit here; pick a T5-XXL file. {T5_FILE_HINT}"
        )
    if any(
        key.startswith("encoder.block.1.layer.0.SelfAttention.relative_attention_bias") for key in tensors
    ):
        raise ValueError(
            f"t5_file {name!r} is a UMT5 encoder (a position bias in every layer, e.g. umt5_xxl for Wan), "
            f"not the T5 v1.1 encoder PixArt-Σ was trained with; pick a T5-XXL file. {T5_FILE_HINT}"
        )
    gated = "encoder.block.0.layer.1.DenseReluDense.wi_0.weight" in tensors
    num_layers = max(blocks) + 1
    weights = [embeddings[0], _BIAS, _FINAL_NORM]
    weights += [key for block in range(num_layers) for key in _t5_block_keys(block, gated)]
    missing = [key for key in weights if key not in tensors]
    if missing:
        raise ValueError(
            f"t5_file {name!r} lacks {len(missing)} of the {len(weights)} weights of a {num_layers}-layer T5 "
            f"encoder (e.g. {', '.join(missing[:3])}): the file is damaged or holds another model. {T5_FILE_HINT}"
        )
    quantized = [key for key in weights if tensors[key][0] not in _FLOAT_DTYPES]
    if quantized:
        raise ValueError(
            f"t5_file {name!r} stores {quantized[0]} as {tensors[quantized[0]][0]}, a quantized format the pack "
            f"does not read; pick a fp16, bf16 or fp8 (e4m3fn) T5 file. {T5_FILE_HINT}"
        )

    known = set(weights)
    scales = []
    for key, (_dtype, shape) in tensors.items():
        suffix = next((s for s in _SCALE_SUFFIXES if key.endswith(s)), None)
        if suffix is None or (weight := key.removesuffix(suffix) + ".weight") not in known:
            continue
        if math.prod(shape) != 1:
            raise ValueError(
                f"t5_file {name!r} scales {weight} with a {list(shape)} tensor; only one scale per weight is "
                f"supported. Pick a fp16, bf16 or fp8 T5 file. {T5_FILE_HINT}"
            )
        scales.append((weight, key))
    unused = sorted(set(tensors) - known - {scale for _weight, scale in scales})
    if unused:  # e.g. the tied copy of the embeddings, a stray logit_scale, the scaled_fp8 marker
        logger.debug("%s: ignoring %d tensors a T5 encoder does not use: %s", name, len(unused), unused[:10])

    vocab_size, d_model = tensors[embeddings[0]][1]
    buckets, heads = tensors[_BIAS][1]
    first_ff = f"encoder.block.0.layer.1.DenseReluDense.{'wi_0' if gated else 'wi'}.weight"
    config = dict(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=tensors["encoder.block.0.layer.0.SelfAttention.q.weight"][1][0] // heads,
        d_ff=tensors[first_ff][1][0],
        num_layers=num_layers,
        num_heads=heads,
        relative_attention_num_buckets=buckets,
        relative_attention_max_distance=T5_MAX_DISTANCE,
        feed_forward_proj="gated-gelu" if gated else "relu",
        is_encoder_decoder=False,
        use_cache=False,
    )
    stored = tensors["encoder.block.0.layer.0.SelfAttention.q.weight"][0]
    return T5File(path.resolve(), config, tuple(weights), tuple(scales), stored)


TRANSFORMER_FILE_HINT = (
    "A PixArt-Σ transformer file is one .safetensors file in models/diffusion_models or models/checkpoints: "
    "an original PixArt checkpoint converted to safetensors (e.g. PixArt-Sigma-XL-2-1024-MS.safetensors, the "
    "file ComfyUI's UNETLoader reads) or a diffusers transformer's diffusion_pytorch_model.safetensors."
)
# Every published PixArt (α and Σ, XL-2) has 1152-wide blocks of 16 heads of 72; the weights do not say.
PIXART_HEAD_DIM = 72
# Image side in pixels -> the transformer's sample_size and position-embedding scale, as diffusers'
# conversion of the published checkpoints sets them.
VARIANTS: dict[str, tuple[int, float]] = {
    "256": (32, 0.5),
    "512": (64, 1.0),
    "1024": (128, 2.0),
    "2K": (256, 4.0),
}
_VARIANT_IN_NAME = re.compile(r"(?<![0-9])(2k|2048|1024|512|256)(?![0-9])", re.IGNORECASE)
# Original (PixArt repository) key -> diffusers key, one to one; the fused attention weights follow below.
_ORIGINAL_BASIC = {
    "x_embedder.proj.weight": "pos_embed.proj.weight",
    "x_embedder.proj.bias": "pos_embed.proj.bias",
    "y_embedder.y_proj.fc1.weight": "caption_projection.linear_1.weight",
    "y_embedder.y_proj.fc1.bias": "caption_projection.linear_1.bias",
    "y_embedder.y_proj.fc2.weight": "caption_projection.linear_2.weight",
    "y_embedder.y_proj.fc2.bias": "caption_projection.linear_2.bias",
    "t_embedder.mlp.0.weight": "adaln_single.emb.timestep_embedder.linear_1.weight",
    "t_embedder.mlp.0.bias": "adaln_single.emb.timestep_embedder.linear_1.bias",
    "t_embedder.mlp.2.weight": "adaln_single.emb.timestep_embedder.linear_2.weight",
    "t_embedder.mlp.2.bias": "adaln_single.emb.timestep_embedder.linear_2.bias",
    "t_block.1.weight": "adaln_single.linear.weight",
    "t_block.1.bias": "adaln_single.linear.bias",
    "final_layer.linear.weight": "proj_out.weight",
    "final_layer.linear.bias": "proj_out.bias",
    "final_layer.scale_shift_table": "scale_shift_table",
}
_ORIGINAL_BLOCK = {
    "scale_shift_table": ("scale_shift_table",),
    "attn.qkv.{}": ("attn1.to_q.{}", "attn1.to_k.{}", "attn1.to_v.{}"),
    "attn.proj.{}": ("attn1.to_out.0.{}",),
    "cross_attn.q_linear.{}": ("attn2.to_q.{}",),
    "cross_attn.kv_linear.{}": ("attn2.to_k.{}", "attn2.to_v.{}"),
    "cross_attn.proj.{}": ("attn2.to_out.0.{}",),
    "mlp.fc1.{}": ("ff.net.0.proj.{}",),
    "mlp.fc2.{}": ("ff.net.2.{}",),
}
# In original checkpoints only: the learned empty caption (used in training; its length is the caption
# length ComfyUI reads) and, in fixed-size models, the position embedding diffusers computes itself.
_ORIGINAL_ONLY = ("y_embedder.y_embedding", "pos_embed")
_ALPHA_KEYS = ("ar_embedder.mlp.0.weight", "adaln_single.emb.aspect_ratio_embedder.linear_1.weight")
# A checkpoint ComfyUI 0.38 saved may carry an attention setting per attention layer (its ComfyAttention
# module's state: a JSON text as bytes, e.g. {"attention": "comfy_kitchen_int8"}). They are settings of
# ComfyUI's attention, not weights; the pack runs its own attention and leaves them out.
ATTENTION_SETTING = ".comfy_attention.config"
# ComfyUI's full checkpoints keep the transformer under a prefix.
_PREFIXES = ("", "model.diffusion_model.", "diffusion_model.", "model.")


def original_key_map(depth: int) -> dict[str, tuple[str, ...]]:
    """Original PixArt key -> the diffusers keys it holds, concatenated along dim 0 (q, k, v fused)."""
    mapping = {key: (value,) for key, value in _ORIGINAL_BASIC.items()}
    for block in range(depth):
        for original, parts in _ORIGINAL_BLOCK.items():
            ends = ("weight", "bias") if "{}" in original else ("",)
            for end in ends:
                mapping[f"blocks.{block}.{original.format(end)}"] = tuple(
                    f"transformer_blocks.{block}.{part.format(end)}" for part in parts
                )
    return mapping


@dataclass(frozen=True)
class TransformerFile:
    """A PixArt-Σ transformer saved as one safetensors file, in the original PixArt layout or diffusers'."""

    path: Path
    config: dict[str, Any]  # PixArtTransformer2DModel arguments
    layout: str  # "original" or "diffusers"
    prefix: str  # before every key, e.g. "model.diffusion_model." in a full ComfyUI checkpoint

    @property
    def key(self) -> str:
        return str(self.path)

    @property
    def native_size(self) -> int:
        return int(self.config["sample_size"]) * 8

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under diffusers' names (an original checkpoint's fused q, k, v split)."""
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as f:
            if self.layout == "diffusers":
                return {key.removeprefix(self.prefix): f.get_tensor(key) for key in f.keys()  # noqa: SIM118
                        if key.startswith(self.prefix) and not key.endswith(ATTENTION_SETTING)}  # fmt: skip
            state = {}
            for original, targets in original_key_map(self.config["num_layers"]).items():
                tensor = f.get_tensor(self.prefix + original)
                for target, part in zip(targets, tensor.chunk(len(targets)), strict=True):
                    state[target] = part.contiguous()
            return state


def read_transformer_file(
    path: str | os.PathLike, folder_config: dict[str, Any] | None = None
) -> TransformerFile:
    """Check that ``path`` is a PixArt-Σ transformer saved as one safetensors file and make its diffusers
    config from the shapes in its header (read without the weights). What the weights do not record comes
    from ``folder_config`` (the chosen model folder's transformer config) where its width matches: the
    head count (else 16 heads of 72, as in every published PixArt) and the native size (after a size in
    the file's name: 512, 1024, 2K/2048, 256)."""
    path, tensors = read_single_file_header(path, "transformer_file", TRANSFORMER_FILE_HINT)
    shapes = {key: shape for key, (_dtype, shape) in tensors.items()}
    return _infer_transformer(path, shapes, folder_config or {})


def _infer_transformer(
    path: Path, shapes: dict[str, list[int]], folder_config: dict[str, Any]
) -> TransformerFile:
    name = path.name
    found = [
        (prefix, layout)
        for prefix in _PREFIXES
        for layout, marker in (("original", "t_block.1.weight"), ("diffusers", "adaln_single.linear.weight"))
        if prefix + marker in shapes
    ]
    if not found:
        raise ValueError(
            f"transformer_file {name!r} is not a PixArt transformer: it has neither t_block.1.weight (original "
            f"PixArt) nor adaln_single.linear.weight (diffusers); its first tensors are "
            f"{', '.join(sorted(shapes)[:3]) or 'none'}. {TRANSFORMER_FILE_HINT}"
        )
    prefix, layout = found[0]
    keys = {key.removeprefix(prefix) for key in shapes if key.startswith(prefix)}
    settings = {key for key in keys if key.endswith(ATTENTION_SETTING)}
    if settings:
        logger.info(
            "%s: leaving out %d per-layer attention settings of ComfyUI's (%s…): the sampler runs its own "
            "attention",
            name,
            len(settings),
            min(settings),
        )
        keys -= settings
    if any(key in keys for key in _ALPHA_KEYS):
        raise ValueError(
            f"transformer_file {name!r} is a PixArt-α transformer (it has size and aspect-ratio embedders); this "
            f"sampler runs PixArt-Σ. ComfyUI's own Load Diffusion Model + KSampler run PixArt-α files. "
            f"{TRANSFORMER_FILE_HINT}"
        )
    block = re.compile(r"(?:transformer_)?blocks\.(\d+)\.")
    depth = 1 + max((int(m.group(1)) for key in keys if (m := block.match(key))), default=-1)
    mapping = original_key_map(depth)
    want = {t for targets in mapping.values() for t in targets} if layout == "diffusers" else set(mapping)
    missing = sorted(want - keys)
    unexpected = sorted(keys - want - set(_ORIGINAL_ONLY)) if layout == "original" else sorted(keys - want)
    if depth == 0 or missing or unexpected:
        problem = (
            f"lacks {missing[0]}" if missing else f"has {unexpected[0]}" if unexpected else "has no blocks"
        )
        count = len(missing) + len(unexpected)
        raise ValueError(
            f"transformer_file {name!r} {problem}{f' (and {count - 1} more)' if count > 1 else ''}: it is not a "
            f"PixArt-Σ transformer in the {layout} layout (a damaged file, or a variant such as KV-compressed "
            f"blocks that diffusers' PixArt-Σ does not have). {TRANSFORMER_FILE_HINT}"
        )

    def shape(diffusers_key: str) -> list[int]:
        if layout == "diffusers":
            return shapes[prefix + diffusers_key]
        original = next(key for key, targets in mapping.items() if diffusers_key in targets)
        return shapes[prefix + original]

    patch_weight = shape("pos_embed.proj.weight")  # [width, in_channels, patch, patch]
    width, in_channels, patch = patch_weight[0], patch_weight[1], patch_weight[2]
    config = {
        "in_channels": in_channels,
        "out_channels": shape("proj_out.weight")[0] // (patch * patch),
        "patch_size": patch,
        "num_layers": depth,
        "caption_channels": shape("caption_projection.linear_1.weight")[1],
        "cross_attention_dim": width,
        "norm_type": "ada_norm_single",
        "norm_elementwise_affine": False,
        "norm_eps": 1e-6,
        "num_embeds_ada_norm": 1000,
        "activation_fn": "gelu-approximate",
        "attention_bias": True,
        "use_additional_conditions": False,
    }
    folder_width = folder_config.get("num_attention_heads", 0) * folder_config.get("attention_head_dim", 0)
    if folder_width == width:
        heads, head_dim = folder_config["num_attention_heads"], folder_config["attention_head_dim"]
    elif width % PIXART_HEAD_DIM == 0:
        heads, head_dim = width // PIXART_HEAD_DIM, PIXART_HEAD_DIM
    else:
        raise ValueError(
            f"transformer_file {name!r} has {width}-wide blocks, not PixArt's 1152 (16 heads of 72), and the "
            f"chosen model's transformer config does not say how many heads they have. Pick the model folder the "
            f"file was made from. {TRANSFORMER_FILE_HINT}"
        )
    config["num_attention_heads"], config["attention_head_dim"] = heads, head_dim
    named = _VARIANT_IN_NAME.search(path.stem)
    if named is not None:
        variant = "2K" if named.group(1).lower() in ("2k", "2048") else named.group(1)
        config["sample_size"], config["interpolation_scale"] = VARIANTS[variant]
    elif folder_width == width and "sample_size" in folder_config:
        config["sample_size"] = folder_config["sample_size"]
        config["interpolation_scale"] = folder_config.get("interpolation_scale")
    else:
        config["sample_size"], config["interpolation_scale"] = VARIANTS["1024"]
        logger.info("%s: no size in its name; taking the 1024 px model's sample size", name)
    return TransformerFile(path.resolve(), config, layout, prefix)
