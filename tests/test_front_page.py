"""The front page (README.md) names, where a user looks when ComfyUI does not start, the torch/torchvision
pair that the comfyui tier installs, and where the two commands are, the torch that .ci/setup installs."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_install_and_troubleshooting_name_the_torch_pair_ci_installs():
    spec = re.search(r"TORCH_SPEC=\$\{COMFYUI_TORCH_SPEC:-([^}]*)\}", (REPO / ".ci" / "comfyui").read_text())
    pins = dict(pin.split("==") for pin in spec.group(1).split())
    pair = f"`torch=={pins['torch']} torchvision=={pins['torchvision']}`"
    usage = (REPO / "docs" / "USAGE.md").read_text(encoding="utf-8")
    for where, text in (
        ("Install", section(README, "Install")),
        ("Troubleshooting", section(README, "Troubleshooting")),
        ("USAGE's messages", usage),
    ):
        assert pair in text, f"{where} does not name {pair}"
        assert "operator torchvision::nms does not exist" in text, where


def test_the_docs_name_the_torch_each_script_installs():
    """`.venv` has the torch .ci/setup installs, named where the two commands are; ComfyUI's venvs the
    pair .ci/comfyui installs. No other torch version is named."""
    setup = re.search(r"TORCH_SPEC=\$\{TORCH_SPEC:-torch==([^}\s]+)\}", (REPO / ".ci" / "setup").read_text())
    comfyui = re.search(r"COMFYUI_TORCH_SPEC:-torch==(\S+) ", (REPO / ".ci" / "comfyui").read_text())
    installed = {setup.group(1), comfyui.group(1)}
    assert f"torch {setup.group(1)}'s CPU build" in section(README, "Two commands")
    for name in ("README.md", "docs/CONTRIBUTING.md", "docs/USAGE.md"):
        text = (REPO / name).read_text(encoding="utf-8")
        named = set(re.findall(r"\btorch(?:==| )(\d+\.\d+\.\d+)", text))
        assert named <= installed, (
            f"{name} names torch {sorted(named - installed)}; the scripts install {installed}"
        )
