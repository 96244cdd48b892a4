"""Find PixArt-Σ weights (diffusers folders, a hub id, a single-file T5) and load each component."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

MODEL_INDEX = "model_index.json"
HUB_IDS = ("PixArt-alpha/PixArt-Sigma-XL-2-1024-MS",)
COMPONENTS = ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")
LAYOUT_HINT = (
    "A PixArt-Σ model is a diffusers folder holding model_index.json and the subfolders "
    + ", ".join(COMPONENTS)
    + " (for example a copy of the hub repository PixArt-alpha/PixArt-Sigma-XL-2-1024-MS)."
)


def find_model_folders(roots: Iterable[str | os.PathLike]) -> list[str]:
    """Every folder with a model_index.json under ``roots`` (recursive), as names relative to its root."""
    names: set[str] = set()
    for root in map(Path, roots):
        if not root.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
            if MODEL_INDEX in filenames:
                names.add(Path(dirpath).relative_to(root).as_posix())
                dirnames.clear()  # a model's own subfolders hold no further models
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
    names.discard(".")
    return sorted(names, key=str.lower)


@dataclass(frozen=True)
class ModelSource:
    """A model the user chose: a local diffusers folder, or a hub id fetched on demand."""

    name: str
    path: Path | None = None
    hub_id: str | None = None
    searched: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """Identifies the weights for caches and embeddings metadata."""
        return str(self.path) if self.path is not None else f"hub:{self.hub_id}"

    def folder(self, components: Sequence[str]) -> Path:
        """The local folder holding ``components``, downloading them first for a hub id."""
        folder = self.path if self.path is not None else self._download(components)
        for component in components:
            if not (folder / component).is_dir():
                raise FileNotFoundError(
                    f"model {self.name!r}: folder {folder} has no {component}/ subfolder. {LAYOUT_HINT}"
                )
        return folder

    def config(self, component: str) -> dict:
        """A component's config.json (small; read without loading weights)."""
        name = "scheduler_config.json" if component == "scheduler" else "config.json"
        path = self.folder([component]) / component / name
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise FileNotFoundError(f"model {self.name!r}: cannot read {path}: {exc}. {LAYOUT_HINT}") from exc

    def _download(self, components: Sequence[str]) -> Path:
        from huggingface_hub import snapshot_download

        patterns = [MODEL_INDEX, *(f"{c}/*" for c in components)]
        try:
            return Path(snapshot_download(self.hub_id, allow_patterns=patterns))
        except Exception as exc:
            where = ", ".join(self.searched) or "(no model folders configured)"
            raise FileNotFoundError(
                f"model {self.hub_id!r} is not on this machine and could not be downloaded ({type(exc).__name__}: "
                f"{exc}). Searched the Hugging Face cache and the model folders: {where}. Either go online "
                f"(and leave HF_HUB_OFFLINE unset), or copy the repository into one of those folders, e.g. "
                f"{Path(self.searched[0]) / self.hub_id.split('/')[-1] if self.searched else 'models/diffusers/'}"
                f" with model_index.json at its top."
            ) from exc


def _looks_like_hub_id(name: str) -> bool:
    owner, _, repo = name.partition("/")
    return bool(owner and repo) and "/" not in repo and not name.startswith((".", "~")) and "\\" not in name


def resolve_model(name: str, roots: Iterable[str | os.PathLike] = ()) -> ModelSource:
    """Turn what the user picked into a :class:`ModelSource`, or raise an error that says where to look."""
    roots = [Path(r) for r in roots]
    searched = tuple(str(r) for r in roots)
    if not name or not name.strip():
        raise ValueError(f"model: no model given. {LAYOUT_HINT}")
    candidates = [Path(name).expanduser()] if Path(name).expanduser().is_absolute() else []
    candidates += [root / name for root in roots]
    if _looks_like_hub_id(name):  # a local copy of a hub repository, kept under its repo name
        candidates += [root / name.split("/")[-1] for root in roots]
    if not Path(name).is_absolute():
        candidates.append(Path(name))
    for folder in candidates:
        if folder.is_dir():
            if not (folder / MODEL_INDEX).is_file():
                raise FileNotFoundError(
                    f"model {name!r}: folder {folder} has no {MODEL_INDEX}. {LAYOUT_HINT}"
                )
            return ModelSource(name=name, path=folder.resolve(), searched=searched)
    if name in HUB_IDS or _looks_like_hub_id(name):
        return ModelSource(name=name, hub_id=name, searched=searched)
    raise FileNotFoundError(
        f"model {name!r} was not found. Searched: {', '.join(searched) or '(no model folders given)'}. "
        f"Put the model's folder under one of them, or give a folder path or the hub id {HUB_IDS[0]!r}. "
        f"{LAYOUT_HINT}"
    )


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


def read_t5_file(path: str | os.PathLike) -> T5File:
    """Check that ``path`` is a T5 encoder saved as one safetensors file and infer its config, reading
    only the file's header. Other formats are refused unread: .bin/.pt/.ckpt files are pickles."""
    path = Path(path).expanduser()
    if path.suffix.lower() != ".safetensors":
        raise ValueError(
            f"t5_file {str(path)!r}: only .safetensors files are read; a {path.suffix or 'file without an extension'}"
            f" file may be a pickle, which can run code when loaded and which the pack never opens. Pick the "
            f".safetensors version of the T5 file. {T5_FILE_HINT}"
        )
    if not path.is_file():
        raise FileNotFoundError(f"t5_file {str(path)!r} does not exist. {T5_FILE_HINT}")
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            tensors = {key: (f.get_slice(key).get_dtype(), f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as exc:
        raise ValueError(
            f"t5_file {str(path)!r} is not a readable safetensors file ({exc}). If it was downloaded, the "
            f"download is probably incomplete: download it again."
        ) from exc
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
