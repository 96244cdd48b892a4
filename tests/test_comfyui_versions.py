"""The supported ComfyUI range: a ComfyUI older than the pack's minimum gets one log line that names both
versions and how to update, no traceback and no nodes (the ``comfyui`` tier, a real server told it is
older than it is: a sitecustomize module puts a ``comfyui_version`` of 0.3.40 in place before ComfyUI
imports its own)."""

from __future__ import annotations

import os
import re

import pytest
from comfyui_support import NODE_IDS, running_server

import pixart_lowvram

pytestmark = pytest.mark.comfyui  # skipped without COMFYUI_PATH (conftest.py)

OLD = "0.3.40"


def test_an_older_comfyui_loads_no_node_and_says_why_in_one_line(request, tmp_path, tiny_folder, monkeypatch):
    fake = tmp_path / "site"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text(
        f"import sys, types\nsys.modules['comfyui_version'] = types.SimpleNamespace(__version__={OLD!r})\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(fake), os.environ.get("PYTHONPATH")])))
    with running_server(request, tmp_path / "comfyui", tiny_folder) as server:
        info = server.get("/object_info")
        log = server.log_text(0)
    assert "KSampler" in info  # the server runs
    assert not [node for node in NODE_IDS if node in info]
    lines = [line for line in log.splitlines() if "PixArt-Σ low VRAM needs ComfyUI" in line]
    assert len(lines) == 1, log
    minimum = ".".join(map(str, pixart_lowvram.MIN_COMFYUI))
    assert f"needs ComfyUI {minimum} or newer and found ComfyUI {OLD}" in lines[0]
    assert "Update ComfyUI" in lines[0]
    # No traceback or import failure of the pack's (ComfyUI's own optional nodes may lack packages here).
    for block in re.findall(r"Traceback \(most recent call last\):\n(?:[ \t].*\n)*.*", log):
        assert "pixart" not in block.lower(), block
    assert not [line for line in log.splitlines() if "IMPORT FAILED" in line and "pixart" in line.lower()]
