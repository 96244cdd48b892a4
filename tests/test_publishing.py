"""What the Comfy registry reads, without comfy-cli (bash .ci/publish runs comfy node validate and pack):
tools/publish_address.py writing the repository's address into pyproject.toml, and the icon it points at."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "publish_address.py"
GITHUB = "https://github.com/someone/comfyui-pixart-lowvram"


def publish_address(pyproject: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *args, "--pyproject", str(pyproject)],
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.fixture
def pyproject(tmp_path) -> Path:
    copy = tmp_path / "pyproject.toml"
    copy.write_text((REPO / "pyproject.toml").read_text(encoding="utf-8"), encoding="utf-8")
    return copy


def test_the_address_fills_the_urls_and_the_icon_and_nothing_else(pyproject):
    before = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    assert "urls" not in before["project"] and before["tool"]["comfy"]["Icon"] == ""
    done = publish_address(pyproject, GITHUB + ".git/")
    assert done.returncode == 0, done.stderr
    after = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    assert after["project"].pop("urls") == {"Repository": GITHUB, "Issues": GITHUB + "/issues"}
    icon = after["tool"]["comfy"].pop("Icon")
    assert (
        icon == "https://raw.githubusercontent.com/someone/comfyui-pixart-lowvram/main/docs/images/icon.svg"
    )
    before["tool"]["comfy"].pop("Icon")
    assert after == before, "every other key as it was"
    written = pyproject.read_text(encoding="utf-8")
    again = publish_address(pyproject, "https://gitlab.com/other/pack", "--branch", "release")
    assert again.returncode == 0, again.stderr
    other = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    assert other["project"]["urls"]["Repository"] == "https://gitlab.com/other/pack"
    assert (
        other["tool"]["comfy"]["Icon"] == "https://gitlab.com/other/pack/-/raw/release/docs/images/icon.svg"
    )
    assert publish_address(pyproject, GITHUB).returncode == 0
    assert pyproject.read_text(encoding="utf-8") == written, "the same address gives the same file"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["http://github.com/a/b"], "is not a repository's web address: give https://HOST/OWNER/REPO"),
        (["https://github.com/onlyowner"], "is not a repository's web address"),
        (["https://git.example.org/a/b"], "git.example.org is not GitHub or GitLab: give the icon's address"),
        (["https://git.example.org/a/b", "--icon-url", "ftp://x/icon.svg"], "give an https address"),
    ],
)
def test_a_bad_address_is_refused_in_one_line(pyproject, args, said):
    before = pyproject.read_text(encoding="utf-8")
    done = publish_address(pyproject, *args)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and done.stderr.count("\n") == 1
    assert said in done.stderr
    assert pyproject.read_text(encoding="utf-8") == before, "nothing written"


def test_the_icon_is_a_small_square_svg():
    icon = REPO / "docs" / "images" / "icon.svg"
    root = ET.parse(icon).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    _x, _y, width, height = map(float, root.get("viewBox").split())
    assert width == height and icon.stat().st_size < 4000


def test_the_archive_leaves_out_what_a_user_does_not_need():
    """.comfyignore names the folders bash .ci/publish checks are not in the packed archive."""
    patterns = [
        line.strip()
        for line in (REPO / ".comfyignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert {".ci/", "tests/", "benchmarks/", "tools/"} <= set(patterns)
    assert "node.zip" in (REPO / ".gitignore").read_text(encoding="utf-8").split()
