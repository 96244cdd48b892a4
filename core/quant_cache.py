"""Pre-quantized weights on disk: the first load quantizes and saves, later loads read the small copy.

An entry is a folder named by a hash of the source weights (file names, sizes, modification times)
and the settings (scheme, dtype, library versions): when either changes, the key changes and the
entry is rebuilt. Entries are written beside their final place and renamed into it (atomic), hold
safetensors and JSON only (nothing is unpickled), and an entry that fails to load is deleted and
rebuilt.

Each entry also holds ``source.json``: what it was made from (the component, the source path, the
settings, the library versions, when), written into the entry before it is renamed into place, so an
entry has it from the moment it exists. :func:`describe` turns it into one line for listings; entries
made before it existed have none, and still load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TypeVar

from . import folders

logger = logging.getLogger(__name__)

ENV = "PIXART_LOWVRAM_QUANT_CACHE"
LIBRARIES = ("torch", "transformers", "diffusers", "bitsandbytes", "optimum-quanto")
SOURCE_FILE = "source.json"
UNKNOWN_SOURCE = "(made by an older version: source unknown)"
T = TypeVar("T")

# What each entry folder handed out by entry() is made from, for load_or_build to write beside the weights.
_sources: dict[Path, dict] = {}
# Cache folders load_or_build could not write to and has said so: once per folder and process, not once
# per model or prompt.
_unwritable: set[Path] = set()


def default_dir() -> Path:
    """``$PIXART_LOWVRAM_QUANT_CACHE``, else ``quantized/`` in the pack's home folder (:func:`folders.home`)."""
    return Path(os.environ.get(ENV) or folders.home() / "quantized")


def _versions() -> dict[str, str]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def files_signature(source: Path) -> list[tuple[str, int, int]]:
    """The files of ``source`` (a weights file, or a folder and everything under it) as (name, size,
    modification time): what tells weights changed on disk from the same weights."""
    base, files = (source.parent, [source]) if source.is_file() else (source, sorted(source.rglob("*")))
    return [
        (p.relative_to(base).as_posix(), p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.is_file()
    ]


def _digest(component: str, source: Path, settings: dict, versions: dict[str, str]) -> str:
    fingerprint = {
        "component": component,
        "files": files_signature(source),
        "settings": {k: str(v) for k, v in sorted(settings.items())},
        "versions": versions,
    }
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:20]


def entry(root: Path, component: str, source: Path, settings: dict) -> Path:
    """The entry folder for ``component``'s weights under ``source`` (a folder, or a single weights
    file) quantized with ``settings``."""
    versions = _versions()
    folder = root / f"{component}-{_digest(component, source, settings, versions)}"
    _sources[folder] = {
        "component": component,
        "source": str(Path(source).absolute()),
        "settings": {k: str(v) for k, v in sorted(settings.items())},
        "versions": versions,
    }
    return folder


def load_or_build(
    folder: Path,
    load: Callable[[Path], T],
    build: Callable[[], T],
    save: Callable[[T, Path], None],
) -> T:
    """Load the entry at ``folder``; otherwise (absent or unreadable) build, save atomically, return."""
    if folder.is_dir():
        try:
            return load(folder)
        except Exception as exc:  # a truncated or foreign file: rebuild rather than fail the prompt
            logger.warning("quantized cache entry %s is unreadable (%s); rebuilding it", folder, exc)
            shutil.rmtree(folder, ignore_errors=True)
    model = build()
    staging = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", suffix=".partial", dir=folder.parent))
        save(model, staging)
        if folder in _sources:  # written before the rename, so the entry never exists without it
            record = {**_sources[folder], "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
            (staging / SOURCE_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        if not folder.exists():  # else another process finished first; keep theirs
            staging.rename(folder)
    except OSError as exc:  # a full or read-only disk must not fail the stage: the model is loaded
        if folder.parent not in _unwritable:
            _unwritable.add(folder.parent)
            logger.warning(
                "the pre-quantized weight cache %s cannot be written (%s): going on without it, "
                "quantizing on every load. Set %s to a writable folder.",
                folder.parent,
                exc.strerror or exc,
                ENV,
            )
    finally:  # also on Ctrl-C: no half-written entry is left behind
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return model


def size(entry: Path) -> int:
    """Bytes on disk under ``entry``."""
    return sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())


def entries(root: Path) -> list[Path]:
    """The entries under ``root`` (not the leftovers of writes in progress or interrupted)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("*-*") if p.is_dir() and not p.name.endswith(".partial"))


def source_of(entry: Path) -> dict | None:
    """What ``entry`` was made from (its ``source.json``: component, source, settings, versions,
    created), or None for an entry made before entries recorded it, or whose record is unreadable."""
    try:
        record = json.loads((entry / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def describe(entry: Path) -> str:
    """One line for listings: the component, the source it was made from and the scheme, e.g.
    ``text_encoder from /models/PixArt-Sigma/text_encoder, nf4, made 2025-12-01``, marked when the
    source is gone or has changed since (the entry is then no longer used, and can be deleted)."""
    record = source_of(entry)
    if record is None:
        return f"{entry.name.rsplit('-', 1)[0]} {UNKNOWN_SOURCE}"
    component = record.get("component") or entry.name.rsplit("-", 1)[0]
    source = Path(str(record.get("source", "?")))
    settings = record.get("settings") if isinstance(record.get("settings"), dict) else {}
    line = f"{component} from {source}, {settings.get('scheme', 'scheme unknown')}"
    if record.get("created"):
        line += f", made {str(record['created'])[:10]}"
    try:
        if not source.exists():
            line += " (source gone: unused)"
        elif _digest(component, source, settings, _versions()) != entry.name.rsplit("-", 1)[-1]:
            line += " (stale: the source or the libraries changed since; unused)"
    except OSError:
        pass
    return line


def clear(root: Path) -> int:
    """Delete every entry (and leftovers of interrupted writes) under ``root``; return the bytes freed."""
    freed = 0
    if root.is_dir():
        for path in root.iterdir():
            if path.is_dir():
                freed += size(path)
                shutil.rmtree(path)
    return freed
