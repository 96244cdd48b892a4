"""The load/soak script (``benchmarks/soak.py``) in a real ComfyUI on the CPU with the tiny model (the
``comfyui`` tier): every prompt succeeds with its image, the server's host memory does not grow from prompt 4
to the last by more than 5 %, and no kept model is left with keep_loaded off. (The GPU criterion, allocated
memory back within 64 MiB after each prompt, needs CUDA: the script marks it n/a here.) Also the script's
refusal of a non-loopback server and its verdicts on figures that break a criterion (``--judge``), without a
server.

Needs COMFYUI_PATH for the server tests; COMFYUI_PYTHON names the server's interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from comfyui_support import MODEL

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SOAK = BENCHMARKS / "soak.py"
COUNT, HOST_FROM = 12, 4
MIB = 2**20


def run_soak(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SOAK), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def criteria(result: dict) -> dict[str, bool | None]:
    return {check["name"]: check["passed"] for check in result["criteria"]}


@pytest.mark.comfyui
def test_soak_on_the_cpu_started_server(tmp_path, tiny_folder):
    out = tmp_path / "out"
    done = run_soak(
        "--comfyui",
        os.environ["COMFYUI_PATH"],
        "--cpu",
        "--model-dir",
        str(tiny_folder),
        "--size",
        "64",
        "--steps",
        "2",
        "--count",
        str(COUNT),
        "--host-from",
        str(HOST_FROM),
        "--out",
        str(out),
        "--work",
        str(out),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((out / "soak.json").read_text())
    prompts = result["prompts"]
    assert [p["index"] for p in prompts] == list(range(1, COUNT + 1))
    assert [p.get("error") for p in prompts] == [None] * COUNT
    assert [p["images"] for p in prompts] == [1] * COUNT
    assert len(list((out / "images").glob("*.png"))) == COUNT
    # Every prompt ran all three stages (the T5 text differs per prompt, so ComfyUI cached nothing).
    assert all([s["stage"] for s in p["stages"]] == ["t5_encode", "sample", "vae_decode"] for p in prompts)
    growth = (prompts[-1]["rss"] - prompts[HOST_FROM - 1]["rss"]) / prompts[HOST_FROM - 1]["rss"] * 100
    assert growth <= 5, f"host RSS grew {growth:.2f} % from prompt {HOST_FROM} to {COUNT}"
    assert result["kept_models"] == 0
    assert result["errors"] == []
    verdicts = criteria(result)
    assert verdicts["every prompt succeeded, one image each"] is True
    assert verdicts["no kept model left"] is True
    assert verdicts["GPU allocated memory returns"] is None  # no CUDA
    assert "| every prompt succeeded, one image each | pass |" in (out / "soak.md").read_text()


@pytest.mark.comfyui
def test_soak_attached_with_keep_loaded(server, tmp_path):
    """Attached to a running server (its process found by its port); the three kept models are reported,
    and the Free VRAM prompt at the end drops them."""
    out = tmp_path / "out"
    done = run_soak(
        "--server",
        server.url,
        "--model",
        MODEL,
        "--size",
        "64",
        "--steps",
        "2",
        "--count",
        "2",
        "--host-from",
        "1",
        "--keep-loaded",
        "--out",
        str(out),
        "--work",
        str(out),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((out / "soak.json").read_text())
    assert [p["images"] for p in result["prompts"]] == [1, 1]
    assert result["kept_models"] == 3
    assert result["prompts"][0]["rss"] > 100 * MIB  # the server's Python with torch, not a stray process


@pytest.mark.parametrize(
    "url", ["http://192.168.1.5:8188", "http://example.com:8188", "https://127.0.0.1:8188"]
)
def test_soak_refuses_a_server_off_loopback(url, tmp_path):
    done = run_soak(
        "--server", url, "--model", MODEL, "--out", str(tmp_path), "--work", str(tmp_path), timeout=120
    )
    assert done.returncode == 2
    assert "this machine only" in done.stderr and "127.0.0.1" in done.stderr


def figures(rss: list[int], allocated: list[int | None], before: int | None = 0, kept: int = 0) -> dict:
    prompts = [
        {"index": i, "images": 1, "rss": r, "allocated": a, "start_allocated": a}
        for i, (r, a) in enumerate(zip(rss, allocated, strict=True), 1)
    ]
    return {
        "prompts": prompts,
        "before": {"allocated": before},
        "after_free": {"allocated": before},
        "kept_models": kept,
    }


def judge(figures: dict, tmp_path: Path) -> list[dict]:
    """The soak's verdicts on recorded ``figures``, as ``soak.py --judge`` gives them (4 prompts, host
    growth from prompt 2)."""
    recorded = tmp_path / "figures.json"
    recorded.write_text(json.dumps(figures))
    done = run_soak("--judge", str(recorded), "--count", "4", "--host-from", "2", timeout=120)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    return json.loads(done.stdout)


def test_soak_verdicts(tmp_path):
    ok = judge(figures([100, 100, 100, 104], [0, MIB, 0, 64 * MIB]), tmp_path)
    assert [c["passed"] for c in ok] == [True, True, True, True]
    grown = judge(figures([100, 100, 100, 106], [0, 0, 0, 65 * MIB], kept=1), tmp_path)
    assert [c["passed"] for c in grown] == [True, False, False, False]
    assert grown[2]["growth_percent"] == pytest.approx(6.0)
    cpu = judge(figures([100] * 4, [None] * 4, before=None), tmp_path)
    assert cpu[1]["passed"] is None
    short = judge(figures([100, 100], [0, 0]), tmp_path)
    assert short[0]["passed"] is False  # two of four prompts
