"""The benchmarks and their results, without a GPU, each script run in a subprocess (the tests import
nothing from benchmarks/): the wing is the maintained scripts and stays small; every script answers --help;
the harness stamps a run with the git tree of this working tree and, where it is committed, its commit;
benchmarks/results/ holds one current result per benchmark, its Markdown made from its JSON by the
script's own writer. That benchmarks/ imports nothing from tests/ is tests/test_import_boundary.py's."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
RESULTS = BENCHMARKS / "results"
# Not benchmarks: what they share, and ComfyUI's main.py run as on a smaller card.
SUPPORT = ("harness", "card_limit")
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem not in SUPPORT)
KEPT = sorted(p.stem for p in RESULTS.glob("*.json"))
MAX_LINES = 2400
SHA = re.compile(r"[0-9a-f]{40}")


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{script}.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=REPO,
    )


def git(*args: str, env: dict | None = None) -> str | None:
    done = subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False, env=env
    )
    return done.stdout.strip() if done.returncode == 0 else None


def test_the_scripts_are_the_maintained_ones():
    assert SCRIPTS == ["compute", "front", "soak"]
    assert all((BENCHMARKS / f"{name}.py").is_file() for name in SUPPORT)


def test_the_benchmark_folder_is_at_most_2400_lines():
    """Every file under benchmarks/ but its results (and what git ignores there: traces, bytecode)."""
    skipped = {"results", "traces", "__pycache__"}
    files = [
        p for p in BENCHMARKS.rglob("*") if p.is_file() and not skipped & set(p.relative_to(BENCHMARKS).parts)
    ]
    lines = {p.relative_to(REPO).as_posix(): len(p.read_bytes().splitlines()) for p in files}
    assert sum(lines.values()) <= MAX_LINES, lines


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help(script):
    done = run(script, "--help")
    assert done.returncode == 0, done.stderr
    assert "--out" in done.stdout and "--render" in done.stdout


def test_the_stamp_names_this_tree(tmp_path):
    """The tree is what ``git add -A; git write-tree`` gives for this working tree (in an index of its own,
    leaving the checkout's alone); where the working tree is committed, the commit is HEAD."""
    done = run("harness")
    assert done.returncode == 0, done.stderr
    stamp = json.loads(done.stdout)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", stamp["date"])
    assert stamp["gpu"] == (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    assert stamp["torch"] == torch.__version__
    assert stamp["diffusers"] == metadata.version("diffusers")
    assert stamp["transformers"] == metadata.version("transformers")
    assert stamp["comfyui"] is None
    head = git("rev-parse", "HEAD")
    if head is None:
        pytest.skip("no git history here to check the tree against")
    index = {**os.environ, "GIT_INDEX_FILE": str(tmp_path / "index")}
    assert git("add", "-A", env=index) is not None
    assert stamp["tree"] == git("write-tree", env=index)
    if git("status", "--porcelain"):
        pytest.skip("the working tree has uncommitted changes: no commit to name")
    assert stamp["commit"] == head


def test_results_are_one_current_file_per_benchmark():
    """No dated copies, no folders, no dumps: NAME.json and NAME.md for each benchmark that has a result."""
    files = sorted(p.name for p in RESULTS.iterdir()) if RESULTS.is_dir() else []
    assert files == sorted([f"{name}.json" for name in KEPT] + [f"{name}.md" for name in KEPT])
    for name in KEPT:
        assert re.fullmatch(r"[a-z_]+", name), name
        assert json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))["benchmark"] == name
        assert name in SCRIPTS


@pytest.mark.parametrize("name", KEPT)
def test_every_result_names_the_tree_it_measured(name):
    """A result is one run: its stamp names the tree that ran, and a commit it names has that tree and is
    in this history."""
    stamp = json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))["stamp"]
    assert SHA.fullmatch(stamp["tree"]), stamp
    assert stamp["date"] and stamp["gpu"] and stamp["torch"], stamp
    if stamp["commit"] and git("rev-parse", "HEAD"):
        assert git("rev-parse", f"{stamp['commit']}^{{tree}}") == stamp["tree"], stamp
        assert git("merge-base", "--is-ancestor", stamp["commit"], "HEAD") is not None, stamp["commit"]


@pytest.mark.parametrize("name", KEPT)
def test_each_markdown_is_made_from_its_json(name, tmp_path):
    shutil.copy(RESULTS / f"{name}.json", tmp_path)
    done = run(name, "--render", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    made = (tmp_path / f"{name}.md").read_text(encoding="utf-8")
    assert made == (RESULTS / f"{name}.md").read_text(encoding="utf-8")
