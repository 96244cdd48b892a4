"""benchmarks/front.py, the front page's one command, without a GPU (run in subprocesses: the tests import
nothing from benchmarks/): each row's label says what it runs, README's and BENCHMARKS' figures are what
benchmarks/results/front.json makes, and (comfyui tier) the command runs end to end on CPU servers with the
small model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FRONT = REPO / "benchmarks" / "front.py"


def front(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(FRONT), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


ROWS = json.loads(front("--rows").stdout)


# What a label says, and what its configuration must then hold (and not hold where the label is silent).
SAYS = {
    "as shipped": lambda row: "workflow" in row and not any(row.get(k) for k in ("sets", "drop", "env")),
    "one CUDA graph a step": lambda row: row.get("env") == {"PIXART_LOWVRAM_CUDA_GRAPH": "1"},
    "compute fp8": lambda row: "2.compute=fp8" in row.get("sets", []),
    "compute fp16": lambda row: "2.compute=fp16" in row.get("sets", []),
    "started again": lambda row: row.get("again") is True,
    "no Memory Snapshot": lambda row: "PixArtQ_MemorySnapshot" in row.get("drop", []),
    "without its LoRA": lambda row: "LoraLoaderModelOnly" in row.get("drop", []),
    "basic workflow": lambda row: row.get("workflow") == "pixart_lowvram_basic_api.json",
    "low-VRAM workflow": lambda row: row.get("workflow") == "pixart_lowvram_low_vram_api.json",
    "LoRA + KSampler workflow": lambda row: row.get("workflow") == "pixart_lowvram_lora_ksampler_api.json",
    "ComfyUI core fp16, its defaults": lambda row: row.get("core") is True,
    "anchor": lambda row: row.get("anchor") is True,
}


@pytest.mark.parametrize("name", list(ROWS["rows"]))
def test_each_label_says_what_its_row_runs(name):
    row = ROWS["rows"][name]
    for words, holds in SAYS.items():
        assert (words in name) == holds(row), f"{name!r}: {words!r} and {row}"
    card = re.match(r"(\d+) GB card: ", name)
    assert row.get("card_gb") == (int(card[1]) if card else None), name
    known = {"workflow", "sets", "drop", "core", "anchor", "card_gb", "again", "env"}
    assert set(row) <= known, f"{name}: {set(row) - known} is in no label"


def test_each_group_has_its_anchor_first_and_every_row_once():
    groups = ROWS["groups"]
    assert sorted(n for names in groups.values() for n in names) == sorted(ROWS["rows"])
    for names in groups.values():
        assert ROWS["rows"][names[0]].get("anchor") and not any(
            ROWS["rows"][n].get("anchor") for n in names[1:]
        )
    # Four servers at most a group; the small cards: pack against core on each.
    assert all(len(names) <= 5 for names in groups.values())
    assert [[ROWS["rows"][n].get("card_gb") for n in names] for names in groups.values()] == [
        [None] * 5,
        [None] * 4,
        [None] * 5,
        [None] * 5,
        [None, 8, 8],
        [None, 4, 4],
    ]


def test_the_docs_show_what_front_json_makes():
    done = front("--check")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_docs_say_so_where_there_is_no_result():
    if (REPO / "benchmarks" / "results" / "front.json").is_file():
        pytest.skip("front.json exists: its figures are checked above")
    for doc in ("README.md", "docs/BENCHMARKS.md"):
        assert "has not been measured at this commit" in (REPO / doc).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def tiny_core_folder(tmp_path_factory) -> Path:
    """A small model whose transformer ComfyUI core's loader reads (its detection wants hidden size 1152)."""
    from pixart_lowvram.cli.random_model import build_random_pixart

    return build_random_pixart(tmp_path_factory.mktemp("model") / "tiny-core", "tiny-core")


@pytest.mark.comfyui
def test_the_command_runs_on_cpu_servers(tmp_path, tiny_core_folder):
    """The 8 GB card group (its servers start through the card launcher) for one round on CPU servers: a
    result with every row's prompt and no error, its Markdown, and the docs left alone."""
    before = {doc: (REPO / doc).read_bytes() for doc in ("README.md", "docs/BENCHMARKS.md")}
    comfyui = os.environ["COMFYUI_PATH"]
    done = front(
        *("--model-dir", str(tiny_core_folder), "--comfyui", comfyui, "--cpu-check", "--rounds", "1"),
        *("--group", "8 GB card", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")),
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "out" / "front.json").read_text())
    assert list(result["rows"]) == ROWS["groups"]["8 GB card"]
    for name, row in result["rows"].items():
        assert "error" not in row, f"{name}: {row['error']}"
        assert len(row["prompts"]) == 1 and row["summary"]["mean"] > 0, name
    texts = {(p["text"], p["seed"]) for row in result["rows"].values() for p in row["prompts"]}
    assert len(texts) == 1  # one round: the same new prompt for every row
    assert (
        result["stamp"]["tree"]
        and "| 8 GB card: basic workflow, as shipped |" in (tmp_path / "out" / "front.md").read_text()
    )
    assert {doc: (REPO / doc).read_bytes() for doc in before} == before


def test_a_server_that_cannot_start_is_a_result_with_its_traceback(tmp_path, tiny_core_folder):
    """A ComfyUI whose start fails after a long log (one that speaks of memory): each server row is recorded
    as failed, not as out of memory, with the end of the log, where the traceback is; the anchor runs."""
    comfyui = tmp_path / "ComfyUI"
    comfyui.mkdir()
    (comfyui / "main.py").write_text(
        "import sys\nfor i in range(400):\n    print('Enabled pinned memory', i, flush=True)\n"
        "raise ModuleNotFoundError(\"No module named 'pydantic'\")\n"
    )
    done = front(
        *("--model-dir", str(tiny_core_folder), "--comfyui", str(comfyui), "--cpu-check", "--rounds", "1"),
        *("--group", "8 GB card", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads((tmp_path / "out" / "front.json").read_text())["rows"]
    anchor, *servers = ROWS["groups"]["8 GB card"]
    assert "error" not in rows[anchor] and len(rows[anchor]["prompts"]) == 1
    markdown = (tmp_path / "out" / "front.md").read_text()
    for name in servers:
        assert "No module named 'pydantic'" in rows[name]["error"], rows[name]["error"][-500:]
        assert f"| {name} | failed;" in markdown
    assert "out of memory" not in markdown


def test_the_result_names_the_commit_whose_tree_ran():
    path = REPO / "benchmarks" / "results" / "front.json"
    if not path.is_file():
        pytest.skip("no front.json")
    stamp = json.loads(path.read_text(encoding="utf-8"))["stamp"]
    assert re.fullmatch(r"[0-9a-f]{40}", stamp["commit"] or ""), stamp.get("commit_note")
    tree = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", f"{stamp['commit']}^{{tree}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if tree.returncode != 0:
        pytest.skip("no git history here")
    assert tree.stdout.strip() == stamp["tree"]
