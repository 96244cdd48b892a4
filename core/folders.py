"""The one folder the pack writes to of its own accord, outside the folders it is given (``--out``,
ComfyUI's): ``$PIXART_LOWVRAM_HOME``, else ``pixart_lowvram`` in the user's cache folder
(``$XDG_CACHE_HOME``, else ``~/.cache``). It holds the demo's random models and, unless
``$PIXART_LOWVRAM_QUANT_CACHE`` names another folder, the pre-quantized weights (:mod:`.quant_cache`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

HOME_ENV = "PIXART_LOWVRAM_HOME"


def home() -> Path:
    """``$PIXART_LOWVRAM_HOME``, else ``pixart_lowvram`` in ``$XDG_CACHE_HOME``, else in ``~/.cache``."""
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV])
    # The XDG specification treats an empty XDG_CACHE_HOME as unset.
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pixart_lowvram"


def unwritable(folder: Path) -> OSError | None:
    """Why files cannot be written in ``folder``, or None when they can. Found by writing a temporary file
    there, or in the nearest folder above it that exists (nothing is made): permission bits do not tell (a
    read-only mount, a path under a file, root, who ignores them)."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        return exc
    return None
