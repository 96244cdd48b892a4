"""The command line, run as a user would: ``python -m pixart_lowvram demo|generate``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from pixart_lowvram.cli import main as cli


def run_cli(*args: str, home: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PIXART_LOWVRAM_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pixart_lowvram", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_demo_builds_a_model_and_writes_image_and_report(tmp_path):
    model_dir, out = tmp_path / "model", tmp_path / "out"
    # --device cpu: the report says "no CUDA" even where a GPU is present (the gpu tier covers CUDA).
    proc = run_cli(
        "demo",
        "--model-dir",
        str(model_dir),
        "--out",
        str(out),
        "--steps",
        "2",
        "--device",
        "cpu",
        home=tmp_path / "home",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert (model_dir / "model_index.json").is_file()

    png = out / "pixart_00001.png"
    with Image.open(png) as image:
        assert image.size == (64, 64)
        assert image.mode == "RGB"

    report = json.loads((out / "pixart_00001_memory.json").read_text())
    assert [s["stage"] for s in report["stages"]] == ["t5_encode", "sample", "vae_decode"]
    assert all(s["peak_allocated"] is None and s["error"] is None for s in report["stages"])
    markdown = (out / "pixart_00001_memory.md").read_text()
    assert "no CUDA" in markdown and "t5_encode" in markdown
    if not torch.cuda.is_available():
        assert not (out / "pixart_00001_memory.pickle").exists()
    assert str(png) in proc.stdout
    # Nothing is written to the home folder when --model-dir is given (the pre-quantized weights go to
    # PIXART_LOWVRAM_QUANT_CACHE, which conftest.py sets).
    assert not (tmp_path / "home").exists()


def test_generate_with_a_missing_model_exits_2(tmp_path):
    missing = tmp_path / "no_such_model"
    proc = run_cli(
        "generate", "--model", str(missing), "--out", str(tmp_path / "out"), home=tmp_path, cwd=tmp_path
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ")
    assert str(missing) in proc.stderr and "not found" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", [["--width", "72"], ["--prefix", "../x"]], ids=["width", "prefix"])
def test_generate_rejects_bad_arguments_before_loading(tiny_folder, tmp_path, load_spy, capsys, bad):
    argv = ["generate", "--model", str(tiny_folder), "--out", str(tmp_path), "--steps", "2"]
    assert cli.main([*argv, "--device", "cpu", "--no-snapshot", *bad]) == 2
    assert bad[1] in capsys.readouterr().err
    assert load_spy.total() == 0


def test_only_the_queue_command_needs_the_http_libraries(tmp_path):
    # GPU machines and minimal installs may lack requests/websocket-client; demo, generate and cache
    # must not import them.
    code = (
        "import sys; sys.modules['requests'] = None; sys.modules['websocket'] = None\n"
        "from pixart_lowvram.cli.main import main\n"
        "raise SystemExit(main(['cache', '--dir', sys.argv[1]]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_the_command_line_asks_for_expandable_segments_unless_told_otherwise(monkeypatch):
    """Expandable segments (a lower reserved peak and faster later prompts) unless the
    allocator's settings were chosen; on Linux, where PyTorch offers them."""
    import sys

    from pixart_lowvram.core import measure

    monkeypatch.delenv(measure.ALLOCATOR_SETTINGS, raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    assert measure.prefer_expandable_segments()
    assert measure.os.environ[measure.ALLOCATOR_SETTINGS] == "expandable_segments:True"
    monkeypatch.setenv(measure.ALLOCATOR_SETTINGS, "backend:cudaMallocAsync")
    assert not measure.prefer_expandable_segments()
    assert measure.os.environ[measure.ALLOCATOR_SETTINGS] == "backend:cudaMallocAsync"
    monkeypatch.delenv(measure.ALLOCATOR_SETTINGS)
    monkeypatch.setattr(sys, "platform", "win32")
    assert not measure.prefer_expandable_segments()
    assert measure.ALLOCATOR_SETTINGS not in measure.os.environ
