"""A script run in a fresh Python interpreter, for what one test process cannot show about itself (which
modules an import pulls in, what a first call loads)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def probe(script: str, *args: str, cwd: Path) -> dict:
    """Run ``script`` (``python -c``) with ``args`` in ``cwd`` and return its last line of output, which it
    prints as JSON. ``cwd`` outside the repository keeps the repository root's own folders (``nodes/``) from
    being importable under their bare names."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])
