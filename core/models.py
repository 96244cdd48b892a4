"""Find PixArt-Σ weights: diffusers folders (searched; a transformer-only folder with its base folder), a hub
id, their weights checked before anything loads. Single files' headers are read in single_files.py."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MODEL_INDEX = "model_index.json"
HUB_1024 = "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS"
# The 512 and 2K repositories hold the transformer and scheduler only; their users take T5, tokenizer and
# VAE from the 1024 model.
HUB_IDS = (HUB_1024, "PixArt-alpha/PixArt-Sigma-XL-2-512-MS", "PixArt-alpha/PixArt-Sigma-XL-2-2K-MS")
COMPONENTS = ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")
# The shared parts: what a transformer-only folder (the 2K model, often the 512 one) takes from its base
# folder, a complete 1024 one. A folder takes them only in that shape, with none of them: one that has some
# and lacks another is damaged.
SHARED_PARTS = ("tokenizer", "text_encoder", "vae")
NATIVE_1024 = 128  # the 1024 px models' transformer sample_size (latent pixels)
LAYOUT_HINT = (
    "A PixArt-Σ model is a diffusers folder holding model_index.json and the subfolders "
    + ", ".join(COMPONENTS)
    + " (for example a copy of the hub repository PixArt-alpha/PixArt-Sigma-XL-2-1024-MS). A folder with only "
    "transformer/ and scheduler/ (the 512 or 2K model) borrows "
    + ", ".join(SHARED_PARTS)
    + " from a complete 1024 folder beside it."
)
# Where the errors about a missing part point, instead of repeating LAYOUT_HINT after their own fix.
LAYOUT_POINTER = "The folder layout: docs/USAGE.md#512-1024-and-2k-models."


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


# Every PixArt-Σ folder's model_index.json names this pipeline class (`_class_name`); a folder is the base
# folder only of a folder of the same class.
PIPELINE_CLASS = "PixArtSigmaPipeline"
# Each component's config file, read without its weights.
CONFIG_FILES = {
    "tokenizer": "tokenizer_config.json",
    "text_encoder": "config.json",
    "transformer": "config.json",
    "vae": "config.json",
    "scheduler": "scheduler_config.json",
}
WEIGHTED = ("text_encoder", "transformer", "vae")  # the components with .safetensors weights
TOKENIZER_VOCABULARY = ("tokenizer.json", "spiece.model")  # a T5 tokenizer has one or both
_LISTED = 6  # model folders named in an error, at most


@dataclass(frozen=True)
class ModelSource:
    """A model the user chose: a local diffusers folder, or a hub id fetched on demand."""

    name: str
    path: Path | None = None
    hub_id: str | None = None
    searched: tuple[str, ...] = ()
    # The base folder: the model that supplies the shared parts this one lacks (a 2K folder's T5, tokenizer
    # and VAE), a complete folder of the same pipeline class beside it that passes its own checks (see
    # resolve_model).
    base: ModelSource | None = None
    # Where a base folder was looked for (the model folder's parent) and, when none was found, each model
    # folder there with why it cannot be one: what an error about a missing component names.
    beside: Path | None = None
    considered: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """Identifies the weights for caches and embeddings metadata."""
        return str(self.path) if self.path is not None else f"hub:{self.hub_id}"

    def shared_parts(self) -> dict[str, Path]:
        """Each shared part this local folder lacks and takes from its base folder -> the base folder. Empty
        for a complete folder, for a damaged one (with some of tokenizer/, text_encoder/, vae/ and not all:
        it takes none), for one with no base folder beside it, and for a hub id (what a hub repository lacks
        is known only once it is downloaded; :meth:`shared_parts_note` names the published 512 and 2K ones'
        base model)."""
        if self.path is None or self.base is None or self.base.path is None:
            return {}
        return {
            component: self.base.path for component in SHARED_PARTS if not (self.path / component).is_dir()
        }

    def shared_parts_note(self) -> str | None:
        """One line saying which components come from another model and from where; None when none do.
        :func:`resolve_model` logs it as a warning."""
        if self.path is None:
            if self.base is None or self.name not in HUB_IDS:
                return None
            parts = ", ".join(f"{component}/" for component in SHARED_PARTS)
            return f"model {self.name!r} has no {parts} on the hub: they come from the hub model {self.base.name}"
        shared = self.shared_parts()
        if not shared:
            return None
        parts = ", ".join(f"{component}/" for component in shared)
        they = "they come" if len(shared) > 1 else "it comes"
        return f"model {self.name!r} has no {parts}: {they} from {self.base.path}"

    def folder(self, components: Sequence[str]) -> Path:
        """The local folder holding ``components``, downloading them first for a hub id."""
        folder = self.path if self.path is not None else self._download(components)
        missing = [component for component in components if not (folder / component).is_dir()]
        if not missing:
            return folder
        if self.base is not None and set(missing) <= set(SHARED_PARTS):
            if len(missing) < len(components):
                raise ValueError(
                    f"model {self.name!r}: {', '.join(components)} are not in one folder ({', '.join(missing)} "
                    f"come from {self.base.path or self.base.name}); ask for them one at a time."
                )
            return self.base.folder(components)
        raise FileNotFoundError(self._missing_message(folder, missing))

    def check_complete(self, components: Sequence[str] = COMPONENTS) -> None:
        """Check, before anything loads, that each of ``components`` is there (in this folder, or in its
        base folder beside it) with its config file, the tokenizer with its vocabulary, and
        text_encoder, transformer and vae with readable .safetensors weights (headers only:
        :func:`check_weights`). Reads only small files and loads no model. Raises FileNotFoundError (a
        missing folder, config or weights) or ValueError (an unreadable config, damaged weights) that says
        what is missing, in which folder, and what to do. Pass only what the run needs (no text_encoder/
        when a single-file T5 replaces it, no vae/ with a vae_file …).

        A hub id is not checked: its files are downloaded per component when a stage first needs them,
        and this check never downloads; it returns at once."""
        unknown = [component for component in components if component not in CONFIG_FILES]
        if unknown:
            raise ValueError(
                f"unknown model component {unknown[0]!r}; the components are {', '.join(COMPONENTS)}."
            )
        if self.path is None:
            return
        if not (self.path / MODEL_INDEX).is_file():
            raise FileNotFoundError(
                f"model {self.name!r}: folder {self.path} has no {MODEL_INDEX}. {LAYOUT_HINT}"
            )
        shared = self.shared_parts()
        missing = [c for c in components if not (self.path / c).is_dir() and c not in shared]
        if missing:
            raise FileNotFoundError(self._missing_message(self.path, missing))
        for component in components:
            folder = shared.get(component, self.path) / component
            origin = f" (lent by {shared[component]})" if component in shared else ""
            config = folder / CONFIG_FILES[component]
            if not config.is_file():
                raise FileNotFoundError(
                    f"model {self.name!r}: {folder}{origin} has no {CONFIG_FILES[component]}: the {component}/ "
                    f"folder is incomplete. Copy it again from the model's download. {LAYOUT_HINT}"
                )
            try:
                json.loads(config.read_text())
            except (OSError, ValueError) as exc:
                raise ValueError(
                    f"model {self.name!r}: cannot read {config}{origin}: {exc}. The file is damaged or its "
                    f"download is incomplete: download it (or the model) again."
                ) from exc
            if component == "tokenizer" and not any((folder / f).is_file() for f in TOKENIZER_VOCABULARY):
                raise FileNotFoundError(
                    f"model {self.name!r}: {folder}{origin} has neither {' nor '.join(TOKENIZER_VOCABULARY)}: "
                    f"the tokenizer/ folder is incomplete. Copy it again from the model's download. {LAYOUT_HINT}"
                )
            if component in WEIGHTED:
                check_weights(folder, self.name)

    def _missing_message(self, folder: Path, missing: Sequence[str]) -> str:
        names = ", ".join(f"{component}/" for component in missing)
        head = (
            f"model {self.name!r}: folder {folder} has no {names} subfolder{'s' if len(missing) > 1 else ''}."
        )
        own = [component for component in missing if component not in SHARED_PARTS]
        present = [f"{component}/" for component in SHARED_PARTS if (folder / component).is_dir()]
        if own:
            return (
                f"{head} Only {', '.join(SHARED_PARTS)} can come from another folder; {', '.join(own)} must be in "
                f"the model's own folder: copy the model again. {LAYOUT_HINT}"
            )
        if self.path is None:
            return f"{head} {LAYOUT_HINT}"
        if present:
            fix = (
                f"It has {', '.join(present)}, so it is a whole model with a part missing (damaged, or not "
                f"copied whole), not a transformer-only 512 or 2K folder, and it borrows nothing. Copy {names} "
                f"again from the model's download (or the whole model)."
            )
        else:
            fix = self._no_base_text()
        return f"{head} {fix} {LAYOUT_POINTER}"

    def _no_base_text(self) -> str:
        beside, considered = self.beside, self.considered
        if beside is None:  # not made by resolve_model
            beside = self.path.parent
            considered = _find_base(self.path, beside, self.searched)[1]
        family = _pipeline_class(self.path) or PIPELINE_CLASS
        if considered:
            more = len(considered) - _LISTED
            listed = "; ".join(considered[:_LISTED]) + (f"; and {more} more" if more > 0 else "")
            found = f"none of the model folders there can lend: {listed}"
        else:
            found = "there is no other model folder there"
        return (
            f"A folder without {', '.join(SHARED_PARTS)} borrows them from a complete PixArt-Σ 1024 folder beside it "
            f"(a {family} by its {MODEL_INDEX}, whole, that passes its own checks) in {beside}, and {found}. Put this folder beside a complete one (e.g. a copy of {HUB_1024}), "
            f"or copy the missing subfolders into it."
        )

    @property
    def native_size(self) -> int:
        """The image side in pixels the transformer was trained at: its config's sample_size × 8."""
        return int(self.config("transformer").get("sample_size", NATIVE_1024)) * 8

    def config(self, component: str) -> dict:
        """A component's config.json (small; read without loading weights)."""
        name = CONFIG_FILES.get(component, "config.json")
        path = self.folder([component]) / component / name
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise FileNotFoundError(f"model {self.name!r}: cannot read {path}: {exc}. {LAYOUT_HINT}") from exc

    def _download(self, components: Sequence[str]) -> Path:
        from huggingface_hub import snapshot_download

        patterns = [MODEL_INDEX, *(f"{c}/*" for c in components)]
        try:
            # Pickled weights are never read, so never fetched either.
            ignore = [f"*{suffix}" for suffix in PICKLE_SUFFIXES]
            return Path(snapshot_download(self.hub_id, allow_patterns=patterns, ignore_patterns=ignore))
        except Exception as exc:
            repo = self.hub_id.split("/")[-1]
            if self.searched:  # a host with model folders (ComfyUI's models/diffusers)
                where = f"the Hugging Face cache and the model folders {', '.join(self.searched)}"
                copy = f"copy the repository into one of those folders, e.g. {Path(self.searched[0]) / repo}"
            else:  # a path or hub id given directly (the command line)
                where = "the Hugging Face cache"
                copy = f"copy the repository to a folder (e.g. ./{repo}) and give that folder's path"
            raise FileNotFoundError(
                f"model {self.hub_id!r} is not on this machine and could not be downloaded ({type(exc).__name__}: "
                f"{exc}). Searched {where}. Either go online (and leave HF_HUB_OFFLINE unset), or {copy} "
                f"with model_index.json at its top."
            ) from exc


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def check_weights(folder: Path, model_name: str) -> Path:
    """Refuse a component folder whose weights are not readable safetensors files, reading only their
    headers, before anything loads: pickled weights (.bin, .pt …) can run code when loaded and are never
    opened, and a damaged file is named with what to do."""
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        pickles = (
            sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
            if folder.is_dir()
            else []
        )
        found = f"only {', '.join(pickles)}, a pickle format" if pickles else "no .safetensors weights"
        raise FileNotFoundError(
            f"model {model_name!r}: {folder} holds {found}. The pack reads .safetensors weights only (a pickle "
            f"can run code when loaded). Download the safetensors version of the model. {LAYOUT_HINT}"
        )
    from safetensors import SafetensorError, safe_open

    for path in files:
        try:
            with safe_open(path, framework="pt"):
                pass
        except (SafetensorError, OSError) as exc:
            raise ValueError(
                f"model {model_name!r}: {path} is not a readable safetensors file ({exc}). It is damaged or its "
                f"download is incomplete: download that file (or the model) again."
            ) from exc
    return folder


def _looks_like_hub_id(name: str) -> bool:
    owner, _, repo = name.partition("/")
    return bool(owner and repo) and "/" not in repo and not name.startswith((".", "~")) and "\\" not in name


def resolve_model(name: str, roots: Iterable[str | os.PathLike] = ()) -> ModelSource:
    """Turn what the user picked into a :class:`ModelSource`, or raise an error that says where to look.
    ``roots`` (ComfyUI's models/diffusers folders) are where a name is looked up.

    A folder that lacks all of tokenizer/, text_encoder/ and vae/ (the shape the 512 and 2K models ship
    in) takes them, the shared parts, from its base folder; one that has some of them and lacks another is
    damaged and takes none (its error names the missing part and the fix). The base folder is a complete
    folder that passes its own checks (:meth:`ModelSource.check_complete`: every part there, configs and
    weights readable)
    of the same pipeline class (model_index.json's ``_class_name``; PixArtSigmaPipeline when the model's
    names none) that sits beside it: a sibling, a folder with the same parent as the model's folder as it
    was named (symlinks not resolved). Nothing below a sibling, elsewhere in the roots or higher up is
    searched. A 1024 base folder (transformer sample_size 128) comes first, then by name. What is shared, and
    from where, is logged as a warning (:meth:`ModelSource.shared_parts_note`)."""
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
    source = None
    for folder in candidates:
        if folder.is_dir():
            if not (folder / MODEL_INDEX).is_file():
                raise FileNotFoundError(
                    f"model {name!r}: folder {folder} has no {MODEL_INDEX}. {LAYOUT_HINT}"
                )
            beside = Path(os.path.abspath(folder)).parent
            folder = folder.resolve()
            base, considered = _find_base(folder, beside, searched)
            source = ModelSource(
                name, folder, searched=searched, base=base, beside=beside, considered=considered
            )
            break
    if source is None and (name in HUB_IDS or _looks_like_hub_id(name)):
        base = ModelSource(HUB_1024, hub_id=HUB_1024, searched=searched) if name != HUB_1024 else None
        source = ModelSource(name=name, hub_id=name, searched=searched, base=base)
    if source is None:
        where = (
            f"Searched: {', '.join(searched)}. Put the model's folder under one of them, or give"
            if searched
            else "There is no folder at that path (relative paths start at the current folder). Give"
        )
        raise FileNotFoundError(
            f"model {name!r} was not found. {where} a folder path or the hub id {HUB_IDS[0]!r}. {LAYOUT_HINT}"
        )
    note = source.shared_parts_note()
    if note is not None:
        logger.warning(note)
    return source


def _pipeline_class(folder: Path) -> str | None:
    """model_index.json's ``_class_name``, or None when it has none (or cannot be read)."""
    try:
        index = json.loads((folder / MODEL_INDEX).read_text())
    except (OSError, ValueError):
        return None
    found = index.get("_class_name") if isinstance(index, dict) else None
    return found if isinstance(found, str) else None


def _cannot_be_base(folder: Path, family: str) -> str | None:
    """Why ``folder`` cannot be the base folder of a folder of pipeline class ``family``; None when it can:
    it must be of that class, have every component itself and pass its own checks (weights' headers read,
    nothing loaded), so that a part is never taken from a damaged model."""
    found = _pipeline_class(folder)
    if found != family:
        return f"a {found}, not a {family}" if found else f"its {MODEL_INDEX} names no {family}"
    for component in COMPONENTS:
        if not (folder / component).is_dir():
            return f"no {component}/"
    try:
        ModelSource(folder.name, folder.resolve()).check_complete()
    except (OSError, ValueError) as exc:
        # The error's first sentence: what is wrong, and where (the fix is for that model's own user).
        return "fails its own check: " + str(exc).removeprefix(f"model {folder.name!r}: ").split(". ")[0]
    return None


def _sample_size(folder: Path) -> int | None:
    try:
        return json.loads((folder / "transformer" / "config.json").read_text()).get("sample_size")
    except (OSError, ValueError, AttributeError):
        return None


def _find_base(
    folder: Path, beside: Path, searched: tuple[str, ...]
) -> tuple[ModelSource | None, tuple[str, ...]]:
    """For a folder without T5, tokenizer and VAE (the 2K model, often the 512 one): its base folder, the
    complete folder of its pipeline class among its siblings in ``beside`` to take them from, a 1024 one
    first (what the 2K model's users pair it with); and, when there is none, each sibling model folder with
    why it cannot be one. Siblings' subfolders are not searched. A folder with any of the three, complete
    or damaged, has no base folder."""
    if any((folder / component).is_dir() for component in SHARED_PARTS):
        return None, ()
    family = _pipeline_class(folder) or PIPELINE_CLASS
    try:
        siblings = sorted(beside.iterdir(), key=lambda path: path.name.lower())
    except OSError:
        siblings = []
    bases, refused = [], []
    for sibling in siblings:
        if sibling.name.startswith(".") or not (sibling / MODEL_INDEX).is_file():
            continue
        resolved = sibling.resolve()
        if resolved == folder:
            continue
        why = _cannot_be_base(sibling, family)
        if why is None:
            bases.append((sibling.name, resolved))
        else:
            refused.append(f"{sibling.name} ({why})")
    if not bases:
        return None, tuple(refused)
    _name, base = min(bases, key=lambda item: (_sample_size(item[1]) != NATIVE_1024, item[0].lower()))
    return ModelSource(name=base.name, path=base, searched=searched), ()
