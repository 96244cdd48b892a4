"""Where the pack writes files: numbered names under one folder, never outside it."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import torch

_PREFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


def check_prefix(prefix: str, name: str = "filename_prefix") -> str:
    """A file name prefix that cannot leave its folder: letters, digits, '_', '-', '.' only."""
    if not _PREFIX.match(prefix or "") or ".." in prefix:
        raise ValueError(
            f"{name} {prefix!r} is not allowed; use 1-100 letters, digits, '_', '-' or '.', starting with a "
            f"letter or digit (no folders, no '..')."
        )
    return prefix


def check_folder(folder: Path, name: str = "output folder") -> Path:
    """Refuse, before any work, an output ``folder`` that is a file or cannot be made (it is made when the
    first file is written)."""
    existing = next(path for path in (folder, *folder.absolute().parents) if path.exists())
    if not existing.is_dir():
        what = "is a file" if existing == folder else f"is inside {str(existing)!r}, which is a file"
        raise ValueError(
            f"{name} {str(folder)!r} {what}; give a folder for the images and the memory report (it is made "
            f"when missing)."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"{name} {str(folder)!r}: {str(existing)!r} is not writable; give a folder you can write to."
        )
    return folder


def next_stem(folder: Path, prefix: str) -> Path:
    """``folder/prefix_00001`` with the first number no existing file of that stem uses."""
    check_prefix(prefix)
    folder.mkdir(parents=True, exist_ok=True)
    pattern = re.compile(re.escape(prefix) + r"_(\d{5})(?:[._]|$)")
    used = [int(m.group(1)) for p in folder.iterdir() if (m := pattern.match(p.name))]
    return folder / f"{prefix}_{max(used, default=0) + 1:05d}"


def save_png(images: torch.Tensor, stem: Path) -> list[Path]:
    """Write each image of ``[B, H, W, C]`` (0..1) as ``stem.png`` (or ``stem_b.png`` for a batch)."""
    from PIL import Image

    paths = []
    for i, image in enumerate(images):
        path = stem.with_name(f"{stem.name}.png" if len(images) == 1 else f"{stem.name}_{i}.png")
        Image.fromarray((image.float().numpy() * 255).round().clip(0, 255).astype(np.uint8)).save(path)
        paths.append(path)
    return paths
