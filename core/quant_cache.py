"""Pre-quantized weights on disk: the first load quantizes and saves, later loads read the small copy.

An entry is a folder named by a hash of the source weights (file names, sizes, modification times)
and the settings (scheme, dtype, library versions): when either changes, the key changes and the
entry is rebuilt. Entries are written beside their final place and renamed into it (atomic), hold
safetensors and JSON only (nothing is unpickled), and an entry that fails to load is deleted and
rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)

ENV = "PIXART_LOWVRAM_QUANT_CACHE"
LIBRARIES = ("torch", "transformers", "diffusers", "bitsandbytes", "optimum-quanto")
T = TypeVar("T")


def default_dir() -> Path:
    """``$PIXART_LOWVRAM_QUANT_CACHE``, else ``quantized/`` in the user's cache folder."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "pixart_lowvram" / "quantized"


def _versions() -> dict[str, str]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def entry(root: Path, component: str, source: Path, settings: dict) -> Path:
    """The entry folder for ``component``'s weights under ``source`` (a folder, or a single weights
    file) quantized with ``settings``."""
    base, files = (source.parent, [source]) if source.is_file() else (source, sorted(source.rglob("*")))
    files = [p for p in files if p.is_file()]
    fingerprint = {
        "component": component,
        "files": [(p.relative_to(base).as_posix(), p.stat().st_size, p.stat().st_mtime_ns) for p in files],
        "settings": {k: str(v) for k, v in sorted(settings.items())},
        "versions": _versions(),
    }
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:20]
    return root / f"{component}-{digest}"


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
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", suffix=".partial", dir=folder.parent))
    try:
        save(model, staging)
        if folder.exists():  # another process finished first; keep theirs
            shutil.rmtree(staging)
        else:
            staging.rename(folder)
    except OSError as exc:  # a full or read-only disk must not fail the stage: the model is loaded
        logger.warning("could not write the quantized cache entry %s: %s", folder, exc)
        shutil.rmtree(staging, ignore_errors=True)
    return model


def size(entry: Path) -> int:
    """Bytes on disk under ``entry``."""
    return sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())


def entries(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("*-*") if p.is_dir()) if root.is_dir() else []


def clear(root: Path) -> int:
    """Delete every entry (and leftovers of interrupted writes) under ``root``; return the bytes freed."""
    freed = 0
    if root.is_dir():
        for path in root.iterdir():
            if path.is_dir():
                freed += size(path)
                shutil.rmtree(path)
    return freed
