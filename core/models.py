"""Find PixArt-Σ weights (diffusers folders or a hub id) and load each component."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

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
