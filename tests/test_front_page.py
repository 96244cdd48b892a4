"""The front page (README.md): short enough to read (and the reference documents within their sizes),
and naming, where a user looks when ComfyUI does not start, the torch/torchvision pair that the comfyui
tier installs on a CPU-only set-up."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
# A front page read to the end; the details are in docs/.
MOST_BYTES = 10_000


def section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_front_page_stays_short():
    assert len(README.encode("utf-8")) <= MOST_BYTES


# A reference someone reads whole: the architecture and the benchmarks' current results.
DOCUMENT_BYTES = {"docs/DESIGN.md": 40_000, "docs/BENCHMARKS.md": 25_000}


def test_the_reference_documents_stay_within_their_sizes():
    sizes = {name: len((REPO / name).read_bytes()) for name in DOCUMENT_BYTES}
    assert all(sizes[name] <= most for name, most in DOCUMENT_BYTES.items()), sizes


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
