"""The benchmarks and their results, without a GPU, each script run in a subprocess (the tests import
nothing from benchmarks/): every script answers --help; the harness stamps a run with this checkout's
commit; benchmarks/results/ holds one current result per benchmark, each naming the commit it measured,
its Markdown made from its JSON by the script's own writer."""

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
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "harness")
KEPT = sorted(p.stem for p in RESULTS.glob("*.json"))
COMMIT = re.compile(r"[0-9a-f]{40}")


def run(script: str, *args: str, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{script}.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
        cwd=cwd,
    )


def git(*args: str) -> str | None:
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def test_the_scripts_are_the_maintained_ones():
    assert SCRIPTS == [
        "comfyui_path",
        "comfyui_sequence",
        "compute",
        "distributed",
        "model_lora",
        "multi_gpu",
        "run_costs",
        "sampler_paths",
        "soak",
        "stages",
        "warm",
    ]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help(script):
    done = run(script, "--help")
    assert done.returncode == 0, done.stderr
    assert "--out" in done.stdout and "--render" in done.stdout


def test_the_stamp_names_this_checkout():
    done = run("harness")
    assert done.returncode == 0, done.stderr
    stamp = json.loads(done.stdout)
    head = git("rev-parse", "HEAD")
    assert stamp["commit"] == head
    if head:
        assert stamp["dirty"] is bool(git("status", "--porcelain", "--untracked-files=no"))
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", stamp["date"])
    assert stamp["gpu"] == (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    assert stamp["torch"] == torch.__version__
    assert stamp["diffusers"] == metadata.version("diffusers")
    assert stamp["transformers"] == metadata.version("transformers")
    assert stamp["comfyui"] is None


@pytest.mark.parametrize("with_git", [False, True], ids=["without git", "with an older git"])
def test_a_copy_takes_the_commit_from_the_environment(tmp_path, with_git):
    """A GPU machine that receives the working tree, without .git or with an older one than its files: the
    commit comes from the environment."""
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(BENCHMARKS / "harness.py", tmp_path / "benchmarks")
    env = os.environ | {"PIXART_LOWVRAM_BENCH_COMMIT": "c" * 40, "PIXART_LOWVRAM_BENCH_DIRTY": "0"}
    env |= {"GIT_CEILING_DIRECTORIES": str(tmp_path.parent)}
    if with_git:
        for args in (("init", "-q"), ("add", "."), ("commit", "-qm", "older")):
            subprocess.run(
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True, env=env
            )
        (tmp_path / "benchmarks" / "harness.py").write_text(
            (tmp_path / "benchmarks" / "harness.py").read_text() + "\n", encoding="utf-8"
        )
    done = subprocess.run(
        [sys.executable, str(tmp_path / "benchmarks" / "harness.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    stamp = json.loads(done.stdout)
    assert (stamp["commit"], stamp["dirty"]) == ("c" * 40, False)
    assert "PIXART_LOWVRAM_BENCH_COMMIT" in stamp["commit_note"]


def test_the_harness_checks_itself():
    done = run("harness", "--self-check")
    assert done.returncode == 0, done.stdout + done.stderr
    assert len([line for line in done.stdout.splitlines() if line.startswith("ok: ")]) == 6


def test_results_are_one_current_file_per_benchmark():
    """No dated copies, no folders, no dumps: NAME.json and NAME.md for each benchmark that has a result."""
    files = sorted(p.name for p in RESULTS.iterdir())
    assert files == sorted([f"{name}.json" for name in KEPT] + [f"{name}.md" for name in KEPT])
    for name in KEPT:
        assert re.fullmatch(r"[a-z_]+", name), name
        assert json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))["benchmark"] == name
        assert name in SCRIPTS


@pytest.mark.parametrize("name", KEPT)
def test_every_result_names_the_commit_it_measured(name):
    result = json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))
    stamps = [result["stamp"]] + [run["stamp"] for run in result.get("runs", [])]
    for stamp in stamps:
        assert COMMIT.fullmatch(stamp["commit"] or ""), stamp
        assert stamp["date"] and stamp["gpu"] and stamp["torch"], stamp
        if git("rev-parse", "HEAD"):
            assert git("merge-base", "--is-ancestor", stamp["commit"], "HEAD") is not None, stamp["commit"]
    if "runs" in result:
        assert result["stamp"] == result["runs"][-1]["stamp"]
        rows = result.get("rows") or result.get("parts")
        assert {row["run"] for row in rows.values()} == set(range(len(result["runs"])))


@pytest.mark.parametrize("name", KEPT)
def test_each_markdown_is_made_from_its_json(name, tmp_path):
    shutil.copy(RESULTS / f"{name}.json", tmp_path)
    done = run(name, "--render", "--out", str(tmp_path), "--name", name)
    assert done.returncode == 0, done.stderr
    made = (tmp_path / f"{name}.md").read_text(encoding="utf-8")
    assert made == (RESULTS / f"{name}.md").read_text(encoding="utf-8")
