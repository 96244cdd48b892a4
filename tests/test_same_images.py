"""tools/same_images.py's parts that need no server: its arguments, the comparison of two PNGs and the
table it prints. The script itself runs two ComfyUI servers (the comfyui tier's venv); its docstring says
how."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "same_images.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("same_images", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def png(pixels: np.ndarray, text: str | None = None) -> bytes:
    info = None
    if text is not None:
        info = PngInfo()
        info.add_text("prompt", text)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG", pnginfo=info)
    return out.getvalue()


def picture(size: int = 8, value: int = 100) -> np.ndarray:
    return np.full((size, size, 3), value, dtype=np.uint8)


def checkout(root: Path, name: str, version: str | None) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "main.py").write_text("", encoding="utf-8")
    if version is not None:
        (folder / "VERSION").write_text(f"ComfyUI v{version}\ncommit 0123\n", encoding="utf-8")
    return folder


def test_the_newest_checkout_is_the_highest_version(tool, tmp_path):
    """By the version number, not the folder's name: v0.33.0 is newer than v0.8.0."""
    checkout(tmp_path, "v0.8.0", "0.8.0")
    newest = checkout(tmp_path, "v0.33.0", "0.33.0")
    checkout(tmp_path, "v0.3.64", "0.3.64")
    checkout(tmp_path, "no-version", None)
    (tmp_path / "not-comfyui").mkdir()
    assert tool.newest_checkout(tmp_path) == newest
    assert tool.newest_checkout(tmp_path / "missing") is None


def test_arguments(tool, tmp_path, capsys):
    comfyui = checkout(tmp_path, "v0.8.0", "0.8.0")
    args = tool.parse_args(["--base", "main~5", "--comfyui", str(comfyui)])
    assert (args.base, args.comfyui, args.python, args.out) == ("main~5", comfyui, sys.executable, None)
    with pytest.raises(SystemExit):
        tool.parse_args(["--comfyui", str(comfyui)])
    assert "--base" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.parse_args(["--base", "HEAD", "--comfyui", str(tmp_path)])
    assert "not a ComfyUI checkout (no main.py)" in capsys.readouterr().err


def test_a_revision_that_is_not_a_commit_is_refused_in_one_line(tool, tmp_path):
    with pytest.raises(tool.CannotCompare, match="--base 'no-such-revision' is not a commit"):
        tool.base_tree("no-such-revision", tmp_path / "base")
    assert not (tmp_path / "base").exists()


def test_how_two_pngs_differ(tool):
    image = picture()
    assert tool.difference(png(image), png(image)) == "same"
    assert tool.difference(png(image, "a"), png(image, "b")) == (
        "differs: same pixels, other bytes (metadata or encoding)"
    )
    changed = image.copy()
    changed[0, 0, 1] += 3
    changed[5, 2] -= 1
    assert tool.difference(png(image), png(changed)) == "differs: 2 of 64 pixels, by up to 3"
    assert tool.difference(png(image), png(picture(size=4))) == "differs: 8x8 RGB vs 4x4 RGB"


def test_the_table_has_a_row_per_image_and_says_why_one_is_missing(tool):
    one, other = png(picture(value=1)), png(picture(value=2))
    names = ["basic", "two_saves", "broken", "needs_engine", "fewer"]
    base = tool.Side(
        images={"basic": [one], "two_saves": [one, one], "fewer": [one, one]},
        failed={"broken": "prompt x failed in node 2"},
        skipped={"needs_engine": "the server has no node type DistributedSeed"},
    )
    work = tool.Side(
        images={"basic": [one], "two_saves": [one, other], "broken": [one], "fewer": [one]},
        skipped={"needs_engine": "the server has no node type DistributedSeed"},
    )
    table = tool.rows(names, base, work)
    assert [(row.workflow, row.result) for row in table] == [
        ("basic", "same"),
        ("two_saves[0]", "same"),
        ("two_saves[1]", "differs: 64 of 64 pixels, by up to 1"),
        ("broken", "failed on the base: prompt x failed in node 2"),
        ("needs_engine", "skipped: the server has no node type DistributedSeed"),
        ("fewer", "differs: 2 vs 1 saved images"),
    ]
    assert table[0].base == table[0].work == tool.sha256(one)
    assert table[2].work == tool.sha256(other) != table[2].base

    text = tool.format_table(table).splitlines()
    assert text[0].split() == ["workflow", "base", "sha256", "working", "tree", "sha256", "result"]
    assert text[1].split() == ["basic", tool.sha256(one)[:16], tool.sha256(one)[:16], "same"]
    # The result column starts at the same place in every row.
    assert len({line.index(row.result) for line, row in zip(text[1:-1], table, strict=True)}) == 1
    assert text[-1] == "2 of 5 images the same; 1 workflow(s) skipped"


def test_only_a_table_of_same_or_skipped_rows_passes(tool):
    same = tool.Row("a", "1", "1", "same")
    skipped = tool.Row("b", "-", "-", "skipped: the server has no node type X")
    differs = tool.Row("c", "1", "2", "differs: 1 of 4 pixels, by up to 1")
    failed = tool.Row("d", "-", "-", "failed on the working tree: prompt y failed in node 3")
    assert tool.passed([same, skipped])
    assert not tool.passed([same, differs])
    assert not tool.passed([failed, skipped])
